// The PrivateUse1 hooks: what torch asks about openreg outside kernels and guards (availability,
// current device, pointers, pinned memory, generators, storage resizing).
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>

#include "common.h"

namespace devipc::openreg {
namespace {

using c10::Device;
using c10::DeviceIndex;

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

  // Non-blocking copies to the CPU ask for pinned memory. The runtime copies from and to any host
  // memory (there is no DMA engine to pin it for), so ordinary CPU memory serves.
  at::Allocator* getPinnedMemoryAllocator() const override {
    return c10::GetCPUAllocator();
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
