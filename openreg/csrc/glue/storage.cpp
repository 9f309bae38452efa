// Tensors over openreg storages: resize_ and set_ keep their memory on openreg (the CPU kernels
// would allocate on the CPU), and storages grow by reallocation on their device.
#include <ATen/native/Resize.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <utility>

#include "kernels.h"

namespace devipc::openreg {
namespace {

using at::Tensor;

// Grows `storage` to hold a tensor of `size` (and `stride`, if given) at `offset`. Called before
// the tensor changes, so that a storage that cannot grow (memory from another process) leaves the
// tensor as it was rather than with sizes beyond its memory.
void grow_storage_for(const c10::Storage& storage, at::IntArrayRef size,
                      at::OptionalIntArrayRef stride, int64_t offset, size_t itemsize) {
  if (offset < 0 || (stride && stride->size() != size.size())) return;  // the callers raise
  for (const int64_t s : size) {
    if (s <= 0) return;  // empty, or invalid: the callers raise
  }
  const size_t nbytes = stride ? at::detail::computeStorageNbytes(size, *stride, itemsize, offset)
                               : at::detail::computeStorageNbytesContiguous(size, itemsize, offset);
  if (nbytes > storage.nbytes()) resize_storage_bytes(storage, nbytes);
}

}  // namespace

void resize_storage_bytes(const c10::Storage& storage, size_t nbytes) {
  TORCH_CHECK(storage.resizable(),
              "openreg: this storage cannot be resized: its memory is shared with other processes "
              "(sent through devipc, or received from another process) or borrowed from elsewhere; "
              "clone() the tensor first");
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  const c10::DeviceGuard guard(storage.device());
  c10::DataPtr fresh = impl->allocator()->allocate(nbytes);
  // Blocking, after the stream's earlier work (which may still write the old block): the old block
  // returns to the cache right after and may be reused at once.
  const size_t kept = std::min(nbytes, impl->nbytes());
  if (kept > 0) {
    OR_CHECK(orStreamSynchronize(current_stream(storage.device().index())));
    OR_CHECK(orMemcpy(fresh.get(), impl->data(), kept, orMemcpyDeviceToDevice));
  }
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(nbytes);
}

const Tensor& resize_(const Tensor& self, at::IntArrayRef size,
                      std::optional<at::MemoryFormat> memory_format) {
  grow_storage_for(self.storage(), size, std::nullopt, self.storage_offset(), self.itemsize());
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), size, std::nullopt,
                               /*resize_storage=*/false);  // the CPU resize would allocate on CPU
  if (memory_format) {
    TORCH_CHECK(*memory_format != at::MemoryFormat::Preserve, "openreg: unsupported memory format ",
                *memory_format);
    self.unsafeGetTensorImpl()->empty_tensor_restride(*memory_format);
  }
  return self;
}

Tensor& set_storage(Tensor& self, c10::Storage source, int64_t offset, at::IntArrayRef size,
                    at::IntArrayRef stride) {
  const at::OptionalIntArrayRef strides =
      stride.data() != nullptr ? at::OptionalIntArrayRef(stride) : std::nullopt;
  if (source.device() == self.storage().device())  // else checkSetStorage raises
    grow_storage_for(source, size, strides, offset, self.itemsize());
  at::native::checkSetStorage(self, source, offset, size, stride);
  self.unsafeGetTensorImpl()->set_storage_offset(offset);
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), size, strides,
                               /*resize_storage=*/false);
  return self;
}

// set_() without arguments: an empty, resizable openreg storage.
Tensor& set_empty(Tensor& self) {
  const c10::DeviceGuard guard(self.device());
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, c10::GetAllocator(kDeviceType),
                     /*resizable=*/true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

}  // namespace devipc::openreg
