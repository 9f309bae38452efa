// The device functions torch.openreg calls through torch.ops.devipc_openreg. They go through what
// torch itself uses (the registered device guard, allocator and generators), so both agree.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <mutex>

#include "common.h"

namespace devipc::openreg {
namespace {

const c10::impl::DeviceGuardImplInterface& guard_impl() {
  return *c10::impl::getDeviceGuardImpl(kDeviceType);
}

c10::Device device_of(int64_t index) {
  return c10::Device(kDeviceType, checked_index(index));
}

TORCH_LIBRARY(devipc_openreg, m) {
  // Unlike the hooks' count (0 when the environment is refused), this one raises with the reason.
  m.def("device_count() -> int", [] {
    int count = 0;
    OR_CHECK(orGetDeviceCount(&count));
    return static_cast<int64_t>(count);
  });
  m.def("current_device() -> int", [] { return static_cast<int64_t>(current_device()); });
  m.def("set_device(int device) -> ()",
        [](int64_t device) { guard_impl().setDevice(device_of(device)); });
  m.def("synchronize(int device) -> ()",
        [](int64_t device) { guard_impl().synchronizeDevice(checked_index(device)); });
  m.def("current_stream_id(int device) -> int", [](int64_t device) {
    return static_cast<int64_t>(guard_impl().getStream(device_of(device)).id());
  });
  // Seeds travel as int64; torch.openreg converts them from and to torch's uint64 seeds.
  m.def("manual_seed(int device, int seed) -> ()", [](int64_t device, int64_t seed) {
    at::Generator& generator = default_generator(device);
    const std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(static_cast<uint64_t>(seed));
  });
  m.def("initial_seed(int device) -> int", [](int64_t device) {
    return static_cast<int64_t>(default_generator(device).current_seed());
  });
  // A generator's state is a CPU byte tensor (openreg's generators are CPU ones: generator.cpp).
  m.def("get_rng_state(int device) -> Tensor", [](int64_t device) {
    at::Generator& generator = default_generator(device);
    const std::lock_guard<std::mutex> lock(generator.mutex());
    return generator.get_state();
  });
  m.def("set_rng_state(int device, Tensor state) -> ()",
        [](int64_t device, const at::Tensor& state) {
          at::Generator& generator = default_generator(device);
          const std::lock_guard<std::mutex> lock(generator.mutex());
          generator.set_state(state);
        });
  m.def("seed(int device) -> int", [](int64_t device) {
    at::Generator& generator = default_generator(device);
    const std::lock_guard<std::mutex> lock(generator.mutex());
    return static_cast<int64_t>(generator.seed());
  });
  m.def("reset_peak_memory_stats(int device) -> ()", [](int64_t device) {
    c10::getDeviceAllocator(kDeviceType)->resetPeakStats(checked_index(device));
  });
  m.def("reset_accumulated_memory_stats(int device) -> ()", [](int64_t device) {
    c10::getDeviceAllocator(kDeviceType)->resetAccumulatedStats(checked_index(device));
  });
  m.def("empty_cache() -> ()", [] { c10::getDeviceAllocator(kDeviceType)->emptyCache(); });
  // devipc's optional make_resizable hook: a sent storage reaches its memory through a DataPtr
  // that keeps the sent block alive for consumers; with openreg's allocator back, resize_ gives
  // the storage new memory and the sent block stays (CUDA's semantics after a send).
  m.def("make_resizable(Tensor self) -> ()", [](const at::Tensor& self) {
    c10::StorageImpl* impl = self.storage().unsafeGetStorageImpl();
    TORCH_CHECK(impl->device_type() == kDeviceType, "openreg: make_resizable of a ",
                impl->device_type(), " storage");
    impl->set_allocator(c10::GetAllocator(kDeviceType));
    impl->set_resizable(true);
  });
}

}  // namespace
}  // namespace devipc::openreg
