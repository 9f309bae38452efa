// Registration of openreg's ATen kernels: allocation, views, copies and resizing are native (views
// alias, copies run on the current stream); every other op runs its CPU kernel in place on the
// openreg memory through the fallback, convolutions included.
// One place, because the order matters: the structured ops below are those still without an
// openreg kernel once the native ones are registered.
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "kernels.h"

namespace devipc::openreg {

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
  m.impl("convolution_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolution_overrideable>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolution_backward_overrideable>());
  m.impl("_thnn_fused_lstm_cell", TORCH_FN(fused_lstm_cell));
  m.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(fused_lstm_cell_backward));
  m.impl("_thnn_fused_gru_cell", TORCH_FN(fused_gru_cell));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(fused_gru_cell_backward));

  // Structured ops (mse_loss, sum.dim_IntList, add_.Tensor, ...) have CPU kernels for each variant
  // but, for other devices, only CompositeExplicitAutogradNonFunctional ones for the functional and
  // in-place variants: these run the meta function on openreg, then call the .out variant with the
  // output it sized. Through the fallback, the CPU .out kernel then runs its meta function again on
  // that output, which is not always idempotent: mse_loss's first sizes the output like the inputs
  // and then to [] for a reduction, so a [] output draws "An output with one or more elements was
  // resized". Running the CPU kernel of the variant called, as the CPU itself does, avoids it.
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    const std::optional<c10::OperatorHandle> op = dispatcher.findOp(name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    const std::string full =
        name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    m.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
  }
}

// copy_ of a conjugate or negative view reaches _copy_from with the bit set; the math-op fallbacks
// would resolve it by a clone, whose copy_ reaches _copy_from again, forever. copy_from handles
// the bits (the CPU's copy does the conversion), as CUDA's copy kernel does.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

}  // namespace devipc::openreg
