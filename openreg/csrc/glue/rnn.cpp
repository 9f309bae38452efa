// The fused LSTM and GRU cells: the RNN modules of CUDA-like devices (PrivateUse1 among them) call
// these, which have no CPU kernel. Written with ATen ops on openreg tensors, which run as CPU
// kernels through the fallback; the workspace layouts are those the autograd formulas expect.
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>

#include <tuple>

#include "kernels.h"

namespace devipc::openreg {
namespace {

using at::Tensor;

Tensor with_biases(const Tensor& gates, const std::optional<Tensor>& bias) {
  return bias && bias->defined() ? gates + *bias : gates;
}

Tensor sum_if(bool has_bias, const Tensor& grad_gates) {
  return has_bias ? grad_gates.sum(0) : Tensor();
}

}  // namespace

// Returns (hy, cy, workspace): the workspace holds the activated gates i, f, g, o.
std::tuple<Tensor, Tensor, Tensor> fused_lstm_cell(const Tensor& input_gates,
                                                   const Tensor& hidden_gates, const Tensor& cx,
                                                   const std::optional<Tensor>& input_bias,
                                                   const std::optional<Tensor>& hidden_bias) {
  const Tensor gates =
      with_biases(with_biases(input_gates + hidden_gates, input_bias), hidden_bias);
  const auto chunks = gates.chunk(4, 1);
  const Tensor i = chunks[0].sigmoid();
  const Tensor f = chunks[1].sigmoid();
  const Tensor g = chunks[2].tanh();
  const Tensor o = chunks[3].sigmoid();
  const Tensor cy = f * cx + i * g;
  const Tensor hy = o * cy.tanh();
  return {hy, cy, at::cat({i, f, g, o}, 1)};
}

// Returns (grad_gates, grad_cx, grad_bias).
std::tuple<Tensor, Tensor, Tensor> fused_lstm_cell_backward(const std::optional<Tensor>& grad_hy,
                                                            const std::optional<Tensor>& grad_cy,
                                                            const Tensor& cx, const Tensor& cy,
                                                            const Tensor& workspace,
                                                            bool has_bias) {
  const auto gates = workspace.chunk(4, 1);
  const Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  const Tensor tanh_cy = cy.tanh();
  Tensor grad_c = grad_cy && grad_cy->defined() ? grad_cy->clone() : at::zeros_like(cy);
  Tensor grad_o = at::zeros_like(o);
  if (grad_hy && grad_hy->defined()) {
    grad_c = grad_c + *grad_hy * o * (1 - tanh_cy * tanh_cy);
    grad_o = *grad_hy * tanh_cy * o * (1 - o);
  }
  const Tensor grad_i = grad_c * g * i * (1 - i);
  const Tensor grad_f = grad_c * cx * f * (1 - f);
  const Tensor grad_g = grad_c * i * (1 - g * g);
  const Tensor grad_gates = at::cat({grad_i, grad_f, grad_g, grad_o}, 1);
  return {grad_gates, grad_c * f, sum_if(has_bias, grad_gates)};
}

// Returns (hy, workspace): the workspace holds r, z, n, hx and the hidden part of n's gate.
std::tuple<Tensor, Tensor> fused_gru_cell(const Tensor& input_gates, const Tensor& hidden_gates,
                                          const Tensor& hx, const std::optional<Tensor>& input_bias,
                                          const std::optional<Tensor>& hidden_bias) {
  const auto in = with_biases(input_gates, input_bias).chunk(3, 1);
  const auto hidden = with_biases(hidden_gates, hidden_bias).chunk(3, 1);
  const Tensor r = (in[0] + hidden[0]).sigmoid();
  const Tensor z = (in[1] + hidden[1]).sigmoid();
  const Tensor n = (in[2] + r * hidden[2]).tanh();
  const Tensor hy = n + z * (hx - n);
  return {hy, at::cat({r, z, n, hx, hidden[2]}, 1)};
}

// Returns (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fused_gru_cell_backward(const Tensor& grad_hy,
                                                                           const Tensor& workspace,
                                                                           bool has_bias) {
  const auto parts = workspace.chunk(5, 1);
  const Tensor &r = parts[0], &z = parts[1], &n = parts[2], &hx = parts[3], &hn = parts[4];
  const Tensor grad_n = grad_hy * (1 - z) * (1 - n * n);
  const Tensor grad_z = grad_hy * (hx - n) * z * (1 - z);
  const Tensor grad_r = grad_n * hn * r * (1 - r);
  const Tensor grad_input = at::cat({grad_r, grad_z, grad_n}, 1);
  const Tensor grad_hidden = at::cat({grad_r, grad_z, grad_n * r}, 1);
  return {grad_input, grad_hidden, grad_hy * z, sum_if(has_bias, grad_input),
          sum_if(has_bias, grad_hidden)};
}

}  // namespace devipc::openreg
