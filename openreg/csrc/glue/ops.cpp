// ATen kernels of openreg: allocation, views, copies and resizing are native (views alias, copies
// run on the current stream); every other op runs on the CPU through a boxed fallback.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common.h"

namespace devipc::openreg {
namespace {

using at::Tensor;

bool on_openreg(const Tensor& t) {
  return t.device().type() == kDeviceType;
}

orStream_t stream_of(const Tensor& t) {
  return current_stream(t.device().index());
}

// ---- factories ----------------------------------------------------------------------------------
void check_factory_options(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "openreg: only strided tensors are supported, got layout ", *layout);
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory),
              "openreg: pin_memory applies to CPU tensors only");
}

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                           std::optional<c10::Layout> layout, std::optional<at::Device> device,
                           std::optional<bool> pin_memory,
                           std::optional<at::MemoryFormat> memory_format) {
  check_factory_options(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));  // the allocator uses it
  return at::detail::empty_generic(size, c10::GetAllocator(kDeviceType), kKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride,
                     std::optional<at::ScalarType> dtype, std::optional<c10::Layout> layout,
                     std::optional<at::Device> device, std::optional<bool> pin_memory) {
  check_factory_options(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, c10::GetAllocator(kDeviceType), kKeys,
                                           c10::dtype_or_default(dtype));
}

// ---- copies -------------------------------------------------------------------------------------
using HostStorages = std::vector<c10::Storage>;

// Host storages with queued copies, made non-resizable meanwhile: resize_ (or storage resize_)
// would free the buffer under the copy. Value: pending copies and the resizability to restore.
struct HostPins {
  std::mutex mutex;
  std::unordered_map<c10::StorageImpl*, std::pair<int, bool>> pins;
};

HostPins& host_pins() {
  static auto* pins = new HostPins();  // never destroyed: host functions may run at exit
  return *pins;
}

void pin_host(const HostStorages& storages) {
  HostPins& h = host_pins();
  const std::lock_guard<std::mutex> lock(h.mutex);
  for (const c10::Storage& s : storages) {
    c10::StorageImpl* impl = s.unsafeGetStorageImpl();
    auto it = h.pins.try_emplace(impl, 0, impl->resizable()).first;
    if (it->second.first++ == 0) impl->set_resizable(false);
  }
}

void unpin_host(const HostStorages& storages) noexcept {
  HostPins& h = host_pins();
  const std::lock_guard<std::mutex> lock(h.mutex);
  for (const c10::Storage& s : storages) {
    c10::StorageImpl* impl = s.unsafeGetStorageImpl();
    auto it = h.pins.find(impl);
    if (it == h.pins.end() || --it->second.first > 0) continue;
    if (it->second.second && impl->allocator() != nullptr) impl->set_resizable(true);
    h.pins.erase(it);
  }
}

// Host memory a queued copy reads or writes must outlive the copy: the stream drops these
// references once the work queued before has run. Until then the storages cannot be resized
// (that would free the memory the copy uses): resize_ raises instead.
void hold_until_done(orStream_t stream, HostStorages storages) {
  auto held = std::make_unique<HostStorages>(std::move(storages));
  pin_host(*held);
  const orError_t err = orLaunchHostFunc(
      stream,
      [](void* p) {
        // Runs on the stream's worker thread, behind a C callback: nothing may escape.
        auto* storages = static_cast<HostStorages*>(p);
        unpin_host(*storages);
        try {
          delete storages;
        } catch (...) {
        }
      },
      held.get());
  if (err != orSuccess) unpin_host(*held);
  OR_CHECK(err);
  held.release();  // owned by the host function now
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

// ---- storage and shape --------------------------------------------------------------------------
// Grows `storage` to hold a tensor of `size` (and `stride`, if given) at `offset`. Called before
// the tensor changes, so that a storage that cannot grow (memory from another process) leaves the
// tensor as it was rather than with sizes beyond its memory.
void grow_storage_for(const c10::Storage& storage, at::IntArrayRef size,
                      at::OptionalIntArrayRef stride, int64_t offset, size_t itemsize) {
  if (offset < 0 || (stride && stride->size() != size.size())) return;  // the callers raise
  for (const int64_t s : size) {
    if (s <= 0) return;  // empty, or invalid: the callers raise
  }
  const size_t nbytes =
      stride ? at::detail::computeStorageNbytes(size, *stride, itemsize, offset)
             : at::detail::computeStorageNbytesContiguous(size, itemsize, offset);
  if (nbytes > storage.nbytes()) resize_storage_bytes(storage, nbytes);
}

const Tensor& resize_(const Tensor& self, at::IntArrayRef size,
                      std::optional<at::MemoryFormat> memory_format) {
  grow_storage_for(self.storage(), size, std::nullopt, self.storage_offset(), self.itemsize());
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), size, std::nullopt,
                               /*resize_storage=*/false);  // the CPU resize would allocate on CPU
  if (memory_format) {
    TORCH_CHECK(*memory_format != at::MemoryFormat::Preserve,
                "openreg: unsupported memory format ", *memory_format);
    self.unsafeGetTensorImpl()->empty_tensor_restride(*memory_format);
  }
  return self;
}

Tensor copy_from_and_resize(const Tensor& self, const Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, /*non_blocking=*/false);
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

at::Scalar local_scalar_dense(const Tensor& self) {
  return at::native::_local_scalar_dense_cpu(to_host(self));
}

// ---- fallback -----------------------------------------------------------------------------------
bool takes_generator(const c10::Argument& argument) {
  c10::TypePtr type = argument.type();
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  return type->kind() == c10::TypeKind::GeneratorType;
}

// The device of the op's first openreg tensor argument, -1 if it has none.
c10::DeviceIndex device_of_arguments(const torch::jit::Stack& stack, size_t first) {
  for (size_t i = first; i < stack.size(); ++i) {
    if (stack[i].isTensor() && on_openreg(stack[i].toTensor()))
      return stack[i].toTensor().device().index();
  }
  return -1;
}

// CPU kernels draw from CPU generators. For the call, an openreg generator (the one passed, or
// the default one of the op's device) lends its state to a CPU twin and takes the advanced state
// back, so seeding openreg (torch.manual_seed) makes its random ops reproducible. The owner stays
// locked for the whole call, as CPU and CUDA kernels hold theirs: two threads never draw the same
// numbers.
class GeneratorLoan {
 public:
  GeneratorLoan(const c10::OperatorHandle& op, torch::jit::Stack& stack,
                c10::DeviceIndex device) {
    const auto& arguments = op.schema().arguments();
    const size_t first = stack.size() - arguments.size();
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (!takes_generator(arguments[i])) continue;
      c10::IValue& value = stack[first + i];
      at::Generator owner = value.isNone()
                                ? at::detail::getPrivateUse1Hooks().getDefaultGenerator(device)
                                : value.toGenerator();
      TORCH_CHECK(owner.device().type() == kDeviceType, "Expected a 'openreg' device type for ",
                  "generator but found '", owner.device().type(), "' (when running ",
                  op.schema().operator_name(), ")");
      at::Generator twin = at::make_generator<at::CPUGeneratorImpl>();
      std::unique_lock<std::mutex> lock(owner.mutex());
      twin.set_state(owner.get_state());
      value = c10::IValue(twin);
      loans_.push_back(Loan{std::move(owner), std::move(twin), std::move(lock)});
    }
  }

  ~GeneratorLoan() {
    for (Loan& loan : loans_) loan.owner.set_state(loan.twin.get_state());
  }

  GeneratorLoan(const GeneratorLoan&) = delete;
  GeneratorLoan& operator=(const GeneratorLoan&) = delete;

 private:
  struct Loan {
    at::Generator owner;
    at::Generator twin;
    std::unique_lock<std::mutex> lock;  // of owner, released after the state went back
  };
  std::vector<Loan> loans_;
};

// The one openreg device of an op's tensor arguments (lists aside), as a device kernel requires:
// a CPU kernel would happily mix openreg:0 and openreg:1, or write into a CPU tensor (which the
// fallback cannot copy back to).
void check_one_device(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                      size_t first) {
  const auto& arguments = op.schema().arguments();
  std::optional<at::Device> device;
  std::optional<at::Device> written_on_cpu;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = stack[first + i];
    if (!value.isTensor() || !value.toTensor().defined()) continue;
    const at::Device here = value.toTensor().device();
    if (!on_openreg(value.toTensor())) {
      const c10::AliasInfo* alias = arguments[i].alias_info();
      if (alias != nullptr && alias->isWrite()) written_on_cpu = here;
      continue;
    }
    TORCH_CHECK(!device || *device == here,
                "Expected all tensors to be on the same device, but found at least two devices, ",
                *device, " and ", here, "! (when running ", op.schema().operator_name(), ")");
    device = here;
  }
  TORCH_CHECK(!device || !written_on_cpu,
              "Expected all tensors to be on the same device, but found at least two devices, ",
              *device, " and ", written_on_cpu.value_or(at::kCPU), "! (", op.schema().operator_name(),
              " writes to a ", written_on_cpu.value_or(at::kCPU), " tensor)");
}

at::IValue to_device(const at::IValue& value, const at::Device& device) {
  if (value.isTensor()) {
    const Tensor& t = value.toTensor();
    return t.defined() && t.is_cpu() ? at::IValue(t.to(device)) : value;
  }
  if (value.isTensorList()) {
    c10::List<Tensor> list = value.toTensorList();
    for (size_t i = 0; i < list.size(); ++i) {
      const Tensor t = list.get(i);
      if (t.defined() && t.is_cpu()) list.set(i, t.to(device));
    }
    return at::IValue(list);
  }
  return value;
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t first = stack->size() - schema.arguments().size();
  check_one_device(op, *stack, first);
  const c10::DeviceIndex op_device = device_of_arguments(*stack, first);
  // The CPU reads inputs through blocking copies on their devices' current streams; syncing the
  // op's device's current stream first also orders the op after work queued there that has no
  // input of this op (an output written by an earlier asynchronous copy, say).
  c10::DeviceIndex device = op_device;  // an op without openreg tensors runs on the current one
  if (device < 0) {
    int current = 0;
    OR_CHECK(orGetDevice(&current));
    device = static_cast<c10::DeviceIndex>(current);
  }
  OR_CHECK(orStreamSynchronize(current_stream(device)));
  {
    const GeneratorLoan loan(op, *stack, device);
    // Views must alias their base, which a CPU copy cannot: an unregistered view op is an error.
    at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
  }
  // at::native::cpu_fallback puts new outputs on the device of the first tensor argument, which
  // is the CPU for torch.where(cpu_mask, x, y) or cpu_scalar * x: as on CUDA, they belong on the
  // op's openreg device.
  if (op_device < 0) return;
  const at::Device target(kDeviceType, op_device);
  const auto& returns = schema.returns();
  const size_t returns_begin = stack->size() - returns.size();
  for (size_t i = 0; i < returns.size(); ++i) {
    if (returns[i].alias_info() != nullptr) continue;  // an argument, already where it was
    at::IValue& value = (*stack)[returns_begin + i];
    value = to_device(value, target);
  }
}

}  // namespace

void resize_storage_bytes(const c10::Storage& storage, size_t nbytes) {
  TORCH_CHECK(storage.resizable(),
              "openreg: this storage cannot be resized (memory opened from another process or "
              "borrowed from elsewhere); clone() the tensor first");
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  const c10::DeviceGuard guard(storage.device());
  c10::DataPtr fresh = impl->allocator()->allocate(nbytes);
  // Blocking: the old block returns to the cache right after and may be reused at once.
  copy_bytes(fresh.get(), impl->data(), std::min(nbytes, impl->nbytes()), orMemcpyDeviceToDevice,
             current_stream(storage.device().index()), {}, /*non_blocking=*/false);
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(nbytes);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("set_.source_Storage", TORCH_FN(at::native::set_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage));
  m.impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));

  // Structured ops (mse_loss, sum.dim_IntList, add_.Tensor, ...) have CPU kernels for each variant
  // but, for other devices, only CompositeExplicitAutogradNonFunctional ones for the functional and
  // in-place variants: these run the meta function on openreg, then call the .out variant with the
  // output it sized. Through the fallback, the CPU .out kernel then runs its meta function again on
  // a copy of that output, which is not always idempotent: mse_loss's first sizes the output like
  // the inputs and then to [] for a reduction, so a [] output draws "An output with one or more
  // elements was resized" and a needless device allocation and copy back. Running the CPU kernel
  // of the variant called, as the CPU itself does, avoids both.
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    const std::optional<c10::OperatorHandle> op = dispatcher.findOp(name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    const std::string full = name.overload_name.empty() ? name.name
                                                        : name.name + "." + name.overload_name;
    m.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

}  // namespace devipc::openreg
