// The ATen kernels of openreg, defined by concern (factories.cpp, copy.cpp, storage.cpp,
// fallback.cpp) and registered together in registration.cpp, whose order matters.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>
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
at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        at::IntArrayRef size, at::IntArrayRef stride);
at::Tensor& set_empty(at::Tensor& self);

// ---- fallback.cpp -------------------------------------------------------------------------------
// Runs an op without an openreg kernel on the CPU, its openreg tensors copied there and back.
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace devipc::openreg
