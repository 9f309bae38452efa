// Factories: empty tensors whose storage is openreg memory from the registered allocator.
#include <ATen/EmptyTensor.h>
#include <c10/core/DeviceGuard.h>

#include "kernels.h"

namespace devipc::openreg {
namespace {

void check_factory_options(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "openreg: only strided tensors are supported, got layout ", *layout);
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory),
              "openreg: pin_memory applies to CPU tensors only");
}

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

}  // namespace

at::Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<at::MemoryFormat> memory_format) {
  check_factory_options(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));  // the allocator uses it
  return at::detail::empty_generic(size, c10::GetAllocator(kDeviceType), kKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<at::Device> device, std::optional<bool> pin_memory) {
  check_factory_options(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, c10::GetAllocator(kDeviceType), kKeys,
                                           c10::dtype_or_default(dtype));
}

}  // namespace devipc::openreg
