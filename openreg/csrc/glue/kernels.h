// The ATen kernels of openreg, defined by concern (factories.cpp, copy.cpp, storage.cpp,
// fallback.cpp) and registered together in registration.cpp, whose order matters.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace devipc::openreg {

// ---- factories.cpp ------------------------------------------------------------------------------
at::Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<at::MemoryFormat> memory_format);
at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<at::Device> device, std::optional<bool> pin_memory);

// ---- copy.cpp -----------------------------------------------------------------------------------
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking);
at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst);
at::Scalar local_scalar_dense(const at::Tensor& self);

// ---- resize_locks.cpp ---------------------------------------------------------------------------
// Keeps host storages alive and unresizable until the work queued so far on `stream` has run.
void hold_until_done(orStream_t stream, std::vector<c10::Storage> storages);

// ---- storage.cpp --------------------------------------------------------------------------------
const at::Tensor& resize_(const at::Tensor& self, at::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format);
at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, at::IntArrayRef size,
                        at::IntArrayRef stride);
at::Tensor& set_empty(at::Tensor& self);

// ---- cpu_alias.cpp ------------------------------------------------------------------------------
// While alive, this thread's CPU allocations are openreg blocks of `device` seen as CPU memory.
class CpuKernelAllocations {
 public:
  explicit CpuKernelAllocations(c10::DeviceIndex device);
  ~CpuKernelAllocations();
  CpuKernelAllocations(const CpuKernelAllocations&) = delete;
  CpuKernelAllocations& operator=(const CpuKernelAllocations&) = delete;

 private:
  c10::DeviceIndex previous_;
};

// A CPU storage over the bytes of an openreg storage, keeping it alive.
c10::Storage cpu_storage_over(const c10::Storage& storage);

// A CPU tensor with t's dtype, geometry and bits over `cpu_storage` (from cpu_storage_over).
at::Tensor cpu_alias(const at::Tensor& t, const c10::Storage& cpu_storage);

// Whether a CPU storage's bytes are an openreg block (allocated under CpuKernelAllocations).
bool in_openreg_memory(const c10::Storage& cpu_storage);

// Those bytes as openreg memory of `device`, keeping the CPU storage alive.
c10::DataPtr openreg_data_of(const c10::Storage& cpu_storage, c10::DeviceIndex device);

// An openreg storage with a CPU storage's bytes: the same block if in_openreg_memory, else a copy.
c10::Storage openreg_storage_of(const c10::Storage& cpu_storage, c10::DeviceIndex device);

// An openreg tensor over `storage` with like's dtype, geometry and bits.
at::Tensor openreg_tensor_over(const c10::Storage& storage, const at::Tensor& like);

// ---- rnn.cpp ------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy,
    const at::Tensor& cx, const at::Tensor& cy, const at::Tensor& workspace, bool has_bias);
std::tuple<at::Tensor, at::Tensor> fused_gru_cell(const at::Tensor& input_gates,
                                                  const at::Tensor& hidden_gates,
                                                  const at::Tensor& hx,
                                                  const std::optional<at::Tensor>& input_bias,
                                                  const std::optional<at::Tensor>& hidden_bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias);

// ---- fallback.cpp -------------------------------------------------------------------------------
// Runs an op without an openreg kernel as its CPU kernel, in place on the openreg memory.
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Runs `cpu_op`'s CPU kernel on a stack of its arguments as cpu_fallback does (convolutions).
void run_on_cpu(const c10::OperatorHandle& cpu_op, torch::jit::Stack* stack);

// convolution_overrideable and its backward, PrivateUse1's convolution entry points.
void convolution_overrideable(const c10::OperatorHandle& op, torch::jit::Stack* stack);
void convolution_backward_overrideable(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace devipc::openreg
