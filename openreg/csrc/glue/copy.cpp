// Copies between openreg and the CPU, or openreg devices: same layouts copy as they are, on the
// current streams; conversions run on the CPU, in place on openreg's memory (host memory).
#include <ATen/ops/_local_scalar_dense_native.h>
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

// The tensor as the CPU sees it: an openreg tensor's alias over the same memory, after the work
// queued on its device's current stream (blocking). A tensor sharing dst's memory gets dst's CPU
// storage, so that the CPU copy sees the overlap.
Tensor on_host(const Tensor& t, const Tensor& dst, const c10::Storage& dst_storage) {
  if (!on_openreg(t)) return t;
  OR_CHECK(orStreamSynchronize(stream_of(t)));
  const bool shared = dst_storage && t.storage().is_alias_of(dst.storage());
  return cpu_alias(t, shared ? dst_storage : cpu_storage_over(t.storage()));
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
    OR_CHECK(
        orMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, orMemcpyDeviceToDevice, dst_stream));
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
    // Conversions run on the CPU, in place on the openreg memory, and block whatever non_blocking
    // says.
    const c10::Storage dst_storage =
        on_openreg(dst) ? cpu_storage_over(dst.storage()) : c10::Storage();
    on_host(dst, dst, dst_storage).copy_(on_host(self, dst, dst_storage));
  }
  return dst;
}

Tensor copy_from_and_resize(const Tensor& self, const Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, /*non_blocking=*/false);
}

at::Scalar local_scalar_dense(const Tensor& self) {
  return at::native::_local_scalar_dense_cpu(on_host(self, self, c10::Storage()));
}

}  // namespace devipc::openreg
