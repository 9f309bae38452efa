// Generators of openreg devices. Random ops run as CPU kernels (the fallback in fallback.cpp), so
// an openreg generator is a CPU generator bound to an openreg device; the fallback lends its state
// to the CPU kernel.
#include <ATen/CPUGeneratorImpl.h>

#include <vector>

#include "common.h"

namespace devipc::openreg {
namespace {

struct Generator final : at::CPUGeneratorImpl {
  explicit Generator(c10::DeviceIndex device) {
    device_ = c10::Device(kDeviceType, device);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

}  // namespace

at::Generator new_generator(c10::DeviceIndex device) {
  return at::make_generator<Generator>(checked_index(device));
}

// Seeded non-deterministically at first use, like CUDA's; torch.manual_seed reseeds them all.
at::Generator& default_generator(int64_t device) {
  static std::vector<at::Generator> generators = [] {
    std::vector<at::Generator> all;
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      all.push_back(new_generator(i));
      all.back().seed();
    }
    return all;
  }();
  return generators[checked_index(device)];
}

}  // namespace devipc::openreg
