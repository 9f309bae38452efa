// Copies between openreg and the CPU, or openreg devices: same layouts copy as they are, on the
// current streams; conversions run on the CPU.
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/DeviceGuard.h>

#include <memory>
#include <utility>
#include <vector>

#include "kernels.h"

namespace devipc::openreg {
namespace {

using at::Tensor;
using HostStorages = std::vector<c10::Storage>;

orStream_t stream_of(const Tensor& t) {
  return current_stream(t.device().index());
}

// A blocking copy returns once it ran; a non-blocking one only holds the host memory it touches.
void copy_bytes(void* dst, const void* src, size_t nbytes, orMemcpyKind kind, orStream_t stream,
                HostStorages host, bool non_blocking) {
  if (nbytes == 0) return;
  if (!non_blocking) {
    // Wait for the stream's earlier work, then copy on this thread: no hand-off to the worker.
    OR_CHECK(orStreamSynchronize(stream));
    OR_CHECK(orMemcpy(dst, src, nbytes, kind));
    return;
  }
  OR_CHECK(orMemcpyAsync(dst, src, nbytes, kind, stream));
  if (!host.empty()) hold_until_done(stream, std::move(host));
}

// Makes `waiter` wait for the work queued so far on `waitee` (streams of different devices).
void stream_wait(orStream_t waiter, orStream_t waitee) {
  int device = 0;
  OR_CHECK(orStreamGetDevice(waitee, &device));
  const c10::DeviceGuard guard(c10::Device(kDeviceType, static_cast<c10::DeviceIndex>(device)));
  orEvent_t event = nullptr;
  OR_CHECK(orEventCreateWithFlags(&event, orEventDisableTiming));
  const std::unique_ptr<orEvent, orError_t (*)(orEvent_t)> owner(event, &orEventDestroy);
  OR_CHECK(orEventRecord(event, waitee));
  OR_CHECK(orStreamWaitEvent(waiter, event, 0));
}

// Elements from a tensor's first element to its last, inclusive (ATen strides are never negative).
int64_t span_numel(const Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return last + 1;
}

size_t span_nbytes(const Tensor& t) {
  return static_cast<size_t>(span_numel(t)) * t.itemsize();
}

Tensor with_bits_of(Tensor host, const Tensor& like) {
  host._set_conj(like.is_conj());
  host._set_neg(like.is_neg());
  return host;
}

// A CPU tensor with t's sizes, strides, bits and values (blocking): the staging step of copies
// that convert dtypes or layouts, which the CPU does.
Tensor to_host(const Tensor& t) {
  Tensor host = at::empty({span_numel(t)}, t.options().device(at::kCPU));
  copy_bytes(host.data_ptr(), t.data_ptr(), span_nbytes(t), orMemcpyDeviceToHost, stream_of(t), {},
             /*non_blocking=*/false);
  return with_bits_of(host.as_strided(t.sizes(), t.strides()), t);
}

// dst := src (CPU, any dtype, broadcastable). A dense dst is written whole; any other is read
// first, so that the memory between its elements keeps its values.
void write_from_host(const Tensor& dst, const Tensor& src, bool non_blocking) {
  Tensor staged =
      dst.is_non_overlapping_and_dense()
          ? with_bits_of(at::empty_strided(dst.sizes(), dst.strides(), dst.options().device(at::kCPU)), dst)
          : to_host(dst);
  staged.copy_(src);
  copy_bytes(dst.data_ptr(), staged.data_ptr(), span_nbytes(dst), orMemcpyHostToDevice,
             stream_of(dst), {staged.storage()}, non_blocking);
}

// Same dtype, sizes, strides and bits, without gaps: the copy is one memcpy.
bool same_dense_layout(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.is_non_overlapping_and_dense() && a.is_conj() == b.is_conj() && a.is_neg() == b.is_neg();
}

void copy_dense(const Tensor& src, const Tensor& dst, bool non_blocking) {
  const size_t nbytes = static_cast<size_t>(src.numel()) * src.itemsize();
  if (!on_openreg(src)) {
    copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, orMemcpyHostToDevice, stream_of(dst),
               {src.storage()}, non_blocking);
  } else if (!on_openreg(dst)) {
    copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, orMemcpyDeviceToHost, stream_of(src),
               {dst.storage()}, non_blocking);
  } else {
    // Device to device never blocks the host, as in CUDA: later work on the stream is ordered
    // after it. Across devices, each side's stream waits for the other's pending work.
    const orStream_t dst_stream = stream_of(dst);
    const orStream_t src_stream = stream_of(src);
    if (dst_stream != src_stream) stream_wait(dst_stream, src_stream);
    OR_CHECK(orMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, orMemcpyDeviceToDevice,
                           dst_stream));
    if (dst_stream != src_stream) stream_wait(src_stream, dst_stream);
  }
}

}  // namespace

Tensor copy_from(const Tensor& self, const Tensor& dst, bool non_blocking) {
  for (const Tensor* t : {&self, &dst}) {
    TORCH_CHECK(on_openreg(*t) || t->is_cpu(), "openreg: cannot copy between ", self.device(),
                " and ", dst.device());
  }
  if (dst.numel() == 0) return dst;
  if (same_dense_layout(self, dst)) {
    copy_dense(self, dst, non_blocking);
  } else {
    // Conversions run on the CPU and block, whatever non_blocking says.
    const Tensor src = on_openreg(self) ? to_host(self) : self;
    if (on_openreg(dst)) {
      write_from_host(dst, src, non_blocking);
    } else {
      dst.copy_(src);
    }
  }
  return dst;
}

Tensor copy_from_and_resize(const Tensor& self, const Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, /*non_blocking=*/false);
}

at::Scalar local_scalar_dense(const Tensor& self) {
  return at::native::_local_scalar_dense_cpu(to_host(self));
}

}  // namespace devipc::openreg
