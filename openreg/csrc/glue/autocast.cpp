// AMP: what torch.autocast("openreg") casts. Torch registers its autocast kernels for CUDA, CPU,
// XPU, MPS and MTIA only, and publishes the op lists of each cast policy so that other backends
// register the same ones: matmuls and convolutions run in the autocast dtype, numerically
// sensitive ops in float32, mixed-input ops in the widest input type. Every other op falls
// through to the ordinary kernels.
//
// Those lists name every op, so this file needs all of ATen's operator headers, which the build
// otherwise forbids to keep recompiles small: it comes last in its unity unit for that reason.
#undef TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace devipc::openreg {
namespace {

using at::Tensor;  // the op lists name types as at::autocast's own registrations see them
using at::Scalar;
using at::ScalarType;
using c10::IntArrayRef;

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

#define OPENREG_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define OPENREG_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define OPENREG_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define OPENREG_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(OPENREG_LOWER_PRECISION_FP)
  AT_FORALL_FP32(OPENREG_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(OPENREG_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(OPENREG_PROMOTE)
}

}  // namespace
}  // namespace devipc::openreg
