// CPU tensors over openreg memory, and back. openreg's device memory is host memory, so a CPU
// kernel can run on it in place: the fallback hands it CPU tensors aliasing the openreg bytes, and
// has the CPU kernel allocate its outputs in openreg memory, which then become openreg tensors
// without a copy.
#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>

#include <utility>

#include "kernels.h"

namespace devipc::openreg {
namespace {

// The fallback's device while it runs a CPU kernel on this thread; -1 otherwise.
thread_local c10::DeviceIndex allocating_on = -1;

void release_storage(void* ctx) {
  delete static_cast<c10::Storage*>(ctx);
}

// A DataPtr over `storage`'s bytes, seen from `device`, that keeps `storage` alive.
c10::DataPtr borrowed(const c10::Storage& storage, c10::Device device) {
  void* data = const_cast<void*>(storage.data());
  return {data, new c10::Storage(storage), &release_storage, device};
}

void free_openreg_block(void* ptr) {
  // A deleter must not throw; a failing orFree means the pointer was not ours: a bug worth a crash.
  const orError_t err = orFree(ptr);
  TORCH_INTERNAL_ASSERT(err == orSuccess, "openreg: orFree failed: ", orGetErrorString(err));
}

// The CPU allocator, unchanged except while the fallback runs a CPU kernel on this thread: then
// the kernel's allocations (its outputs among them) are openreg blocks of the op's device, seen as
// CPU memory. Where the device has no room, they are CPU memory (the fallback copies such outputs).
struct CpuAllocator final : c10::Allocator {
  explicit CpuAllocator(c10::Allocator* base) : base(base) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (allocating_on >= 0 && nbytes > 0) {
      const c10::DeviceGuard guard(c10::Device(kDeviceType, allocating_on));
      void* ptr = nullptr;
      if (orMalloc(&ptr, nbytes) == orSuccess) return {ptr, ptr, &free_openreg_block, c10::kCPU};
    }
    return base->allocate(nbytes);
  }

  // raw_allocate()'d memory comes back here without its DataPtr: tell the blocks apart.
  c10::DeleterFnPtr raw_deleter() const override {
    return &raw_delete;
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    base->copy_data(dest, src, count);
  }

  static void raw_delete(void* ptr) {
    orPointerAttributes attributes{};
    if (orPointerGetAttributes(&attributes, ptr) == orSuccess &&
        attributes.type == orMemoryTypeDevice) {
      free_openreg_block(ptr);
    } else {
      instance->base->raw_deleter()(ptr);
    }
  }

  c10::Allocator* base;
  static CpuAllocator* instance;
};

CpuAllocator* CpuAllocator::instance = [] {
  auto* allocator = new CpuAllocator(c10::GetCPUAllocator());  // never destroyed: used at exit
  c10::SetCPUAllocator(allocator, /*priority=*/1);
  return allocator;
}();

}  // namespace

CpuKernelAllocations::CpuKernelAllocations(c10::DeviceIndex device) : previous_(allocating_on) {
  allocating_on = device;
}

CpuKernelAllocations::~CpuKernelAllocations() {
  allocating_on = previous_;
}

at::Tensor cpu_alias(const at::Tensor& t, const c10::Storage& cpu_storage) {
  at::Tensor alias = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(cpu_storage), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) alias._set_conj(true);
  if (t.is_neg()) alias._set_neg(true);
  return alias;
}

c10::Storage cpu_storage_over(const c10::Storage& storage) {
  // Resizable as the original is: the CPU kernel may resize an out= argument (see write_back).
  return c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(),
                      borrowed(storage, c10::kCPU),
                      storage.resizable() ? c10::GetCPUAllocator() : nullptr, storage.resizable());
}

bool in_openreg_memory(const c10::Storage& cpu_storage) {
  return cpu_storage.nbytes() > 0 && cpu_storage.data_ptr().get_deleter() == &free_openreg_block;
}

c10::DataPtr openreg_data_of(const c10::Storage& cpu_storage, c10::DeviceIndex device) {
  return borrowed(cpu_storage, c10::Device(kDeviceType, device));
}

c10::Storage openreg_storage_of(const c10::Storage& cpu_storage, c10::DeviceIndex device) {
  c10::Allocator* allocator = c10::GetAllocator(kDeviceType);
  const size_t nbytes = cpu_storage.nbytes();
  if (in_openreg_memory(cpu_storage)) {
    return c10::Storage(c10::Storage::use_byte_size_t(), nbytes,
                        openreg_data_of(cpu_storage, device), allocator, /*resizable=*/true);
  }
  const c10::DeviceGuard guard(c10::Device(kDeviceType, device));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, allocator->allocate(nbytes),
                       allocator, /*resizable=*/true);
  if (nbytes > 0)
    OR_CHECK(orMemcpy(storage.mutable_data(), cpu_storage.data(), nbytes, orMemcpyHostToDevice));
  return storage;
}

at::Tensor openreg_tensor_over(const c10::Storage& storage, const at::Tensor& like) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  if (like.is_conj()) t._set_conj(true);
  if (like.is_neg()) t._set_neg(true);
  return t;
}

}  // namespace devipc::openreg
