// The CPU fallback: an op without an openreg kernel runs its CPU kernel on copies of its openreg
// tensors, which go back to openreg afterwards; an openreg generator lends its state to the CPU.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/native/CPUFallback.h>

#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "kernels.h"

namespace devipc::openreg {
namespace {

using at::Tensor;

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
      at::Generator owner = value.isNone() ? default_generator(device) : value.toGenerator();
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

}  // namespace

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t first = stack->size() - schema.arguments().size();
  check_one_device(op, *stack, first);
  const c10::DeviceIndex op_device = device_of_arguments(*stack, first);
  // The CPU reads inputs through blocking copies on their devices' current streams; syncing the
  // op's device's current stream first also orders the op after work queued there that has no
  // input of this op (an output written by an earlier asynchronous copy, say).
  // An op without openreg tensors runs on the current device.
  const c10::DeviceIndex device = op_device >= 0 ? op_device : current_device();
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

}  // namespace devipc::openreg
