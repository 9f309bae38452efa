// The PrivateUse1 hooks: what torch asks about openreg outside kernels and guards (availability,
// current device, pointers, pinned memory, generators, storage resizing).
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>

#include "common.h"

namespace devipc::openreg {
namespace {

using c10::Device;
using c10::DeviceIndex;

void free_pinned(void* ptr) {
  const orError_t err = orFreeHost(ptr);  // a deleter must not throw: failing means a bug
  TORCH_INTERNAL_ASSERT(err == orSuccess, "openreg: orFreeHost failed: ", orGetErrorString(err),
                        " (", orGetLastErrorMessage(), ")");
}

// pin_memory(): CPU tensors in the runtime's pinned host memory (orHostAlloc), which is_pinned()
// recognises and non_blocking copies may use asynchronously.
struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    OR_CHECK(orHostAlloc(&ptr, nbytes));
    return {ptr, ptr, &free_pinned, Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator pinned_allocator;

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }

  bool isAvailable() const override {
    return device_count() > 0;
  }

  // The runtime has no per-device context to create: a visible device is ready.
  bool hasPrimaryContext(DeviceIndex device) const override {
    return device >= 0 && device < device_count();
  }

  DeviceIndex deviceCount() const override {
    return device_count();
  }

  DeviceIndex getCurrentDevice() const override {
    return current_device();
  }

  void setCurrentDevice(DeviceIndex device) const override {
    OR_CHECK(orSetDevice(checked_index(device)));
  }

  DeviceIndex exchangeDevice(DeviceIndex device) const override {
    const DeviceIndex previous = current_device();
    if (device != previous) setCurrentDevice(device);
    return previous;
  }

  DeviceIndex maybeExchangeDevice(DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  Device getDeviceFromPtr(void* data) const override {
    orPointerAttributes attributes{};
    OR_CHECK(orPointerGetAttributes(&attributes, data));
    TORCH_CHECK(attributes.type == orMemoryTypeDevice, "openreg: pointer ", data,
                " is not openreg device memory");
    return Device(kDeviceType, static_cast<DeviceIndex>(attributes.device));
  }

  // pin_memory() and non-blocking copies to the CPU ask for pinned memory.
  at::Allocator* getPinnedMemoryAllocator() const override {
    return &pinned_allocator;
  }

  bool isPinnedPtr(const void* data) const override {
    orPointerAttributes attributes{};
    return orPointerGetAttributes(&attributes, data) == orSuccess &&
           attributes.type == orMemoryTypeHost;
  }

  const at::Generator& getDefaultGenerator(DeviceIndex device) const override {
    return default_generator(device);
  }

  at::Generator getNewGenerator(DeviceIndex device) const override {
    return new_generator(device);
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_storage_bytes(storage, nbytes);
  }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());  // lives as long as the process, like torch's
  return true;
}();

}  // namespace
}  // namespace devipc::openreg
