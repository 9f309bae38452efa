// Dropout draws from openreg's generator. Its kernel, native_dropout, takes no generator argument,
// so the CPU fallback would run the CPU kernel with torch's CPU generator: openreg's RNG state
// (manual_seed, get_rng_state, fork_rng, checkpointing) would not govern it. Here it is built from
// bernoulli_, whose generator the fallback lends from openreg, in the order the CPU kernel draws.
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones_like.h>
#include <torch/library.h>

#include <tuple>

namespace devipc::openreg {
namespace {

std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train) {
  if (input.numel() == 0) return {input, at::empty_like(input)};
  if (train.has_value() && !*train)
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  const double keep = 1.0 - p;
  const at::Tensor kept = at::empty_like(input, at::MemoryFormat::Contiguous).bernoulli_(keep);
  const at::Tensor output = input.mul(kept).mul_(keep == 0.0 ? 0.0 : 1.0 / keep);
  return {output, kept.to(at::kBool)};
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_dropout", TORCH_FN(native_dropout));
}

}  // namespace
}  // namespace devipc::openreg
