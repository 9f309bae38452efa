// The CPU fallback: an op without an openreg kernel runs its CPU kernel in place, on CPU tensors
// aliasing its openreg tensors' memory (openreg memory is host memory), and allocates its outputs
// in openreg memory; an openreg generator lends its state to the CPU.
#include <ATen/CPUGeneratorImpl.h>

#include <cctype>

#include <deque>
#include <mutex>
#include <optional>
#include <string>
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

// The tensors of an argument: itself, or the elements of a list (some may be undefined).
std::vector<Tensor> tensors_of(const c10::IValue& value) {
  if (value.isTensor()) return {value.toTensor()};
  if (value.isTensorList()) return value.toTensorVector();
  std::vector<Tensor> tensors;
  if (value.isOptionalTensorList()) {
    for (const std::optional<Tensor>& t : value.toOptionalTensorList())
      tensors.push_back(t.value_or(Tensor()));
  }
  return tensors;
}

// The device of the op's first openreg tensor (lists included), -1 if it has none.
c10::DeviceIndex device_of_arguments(const torch::jit::Stack& stack, size_t first) {
  for (size_t i = first; i < stack.size(); ++i) {
    for (const Tensor& t : tensors_of(stack[i])) {
      if (t.defined() && on_openreg(t)) return t.device().index();
    }
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
  GeneratorLoan(const c10::OperatorHandle& op, torch::jit::Stack& stack, c10::DeviceIndex device) {
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

// The one openreg device of an op's tensor arguments, as a device kernel requires: a CPU kernel
// would happily mix openreg:0 and openreg:1, or write into a CPU tensor from openreg's stream.
void check_one_device(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  const auto& arguments = op.schema().arguments();
  std::optional<at::Device> device;
  std::optional<at::Device> written_on_cpu;
  for (size_t i = 0; i < arguments.size(); ++i) {
    for (const Tensor& t : tensors_of(stack[first + i])) {
      if (!t.defined()) continue;
      const at::Device here = t.device();
      if (!on_openreg(t)) {
        const c10::AliasInfo* alias = arguments[i].alias_info();
        if (alias != nullptr && alias->isWrite()) written_on_cpu = here;
        continue;
      }
      TORCH_CHECK(!device || *device == here,
                  "Expected all tensors to be on the same device, but found at least two devices, ",
                  *device, " and ", here, "! (when running ", op.schema().operator_name(), ")");
      device = here;
    }
  }
  TORCH_CHECK(!device || !written_on_cpu,
              "Expected all tensors to be on the same device, but found at least two devices, ",
              *device, " and ", written_on_cpu.value_or(at::kCPU), "! (",
              op.schema().operator_name(), " writes to a ", written_on_cpu.value_or(at::kCPU),
              " tensor)");
}

bool same_geometry(const Tensor& a, const Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.storage_offset() == b.storage_offset();
}

// The CPU aliases of one call's openreg arguments, and the openreg tensors of its results.
class Aliases {
 public:
  explicit Aliases(c10::DeviceIndex device) : device_(device) {}

  // The CPU alias of an openreg tensor; other values unchanged. One CPU storage per openreg
  // storage, so that the CPU kernel sees arguments sharing memory as sharing it (overlap checks).
  Tensor alias(const Tensor& t, bool written) {
    if (!t.defined() || !on_openreg(t)) return t;
    const Storage& storage = storage_alias(t.storage());
    tensors_.push_back({t, cpu_alias(t, storage.cpu), written});
    return tensors_.back().cpu;
  }

  c10::IValue alias(const c10::IValue& value, bool written) {
    if (value.isTensor()) return alias(value.toTensor(), written);
    if (value.isTensorList()) {
      c10::List<Tensor> list;
      for (const Tensor& t : value.toTensorVector()) list.push_back(alias(t, written));
      return list;
    }
    if (value.isOptionalTensorList()) {
      c10::List<std::optional<Tensor>> list;
      for (const std::optional<Tensor>& t : value.toOptionalTensorList()) {
        list.push_back(t ? std::optional<Tensor>(alias(*t, written)) : std::nullopt);
      }
      return list;
    }
    return value;
  }

  // A written argument the CPU kernel resized (an out= argument) takes the alias's geometry, and
  // its memory where the kernel had to reallocate it.
  void write_back() {
    for (const TensorAlias& a : tensors_) {
      if (!a.written || same_geometry(a.openreg, a.cpu)) continue;
      const Storage& s = *find(a.cpu.storage());
      const c10::Storage& cpu = a.cpu.storage();
      if (cpu.data() != s.data || cpu.nbytes() != s.nbytes) {
        c10::StorageImpl* impl = s.openreg.unsafeGetStorageImpl();
        if (in_openreg_memory(cpu)) {
          impl->set_data_ptr_noswap(openreg_data_of(cpu, device_));  // no copy
          impl->set_nbytes(cpu.nbytes());
        } else {
          Tensor t = a.openreg;
          set_storage(t, s.openreg, a.cpu.storage_offset(), a.cpu.sizes(), a.cpu.strides());
          copy_from(a.cpu, t, /*non_blocking=*/false);
        }
      }
      a.openreg.unsafeGetTensorImpl()->set_sizes_and_strides(a.cpu.sizes(), a.cpu.strides(),
                                                             a.cpu.storage_offset());
    }
  }

  // A result as an openreg tensor: the argument it is, a view of an argument's memory, or a new
  // tensor over the memory the CPU kernel allocated (a copy where that memory is not openreg's).
  Tensor result(const Tensor& t) {
    if (!t.defined() || !t.is_cpu()) return t;
    for (const TensorAlias& a : tensors_) {
      if (a.cpu.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return a.openreg;
    }
    const Storage* s = find(t.storage());
    if (s == nullptr) {
      storages_.push_back({openreg_storage_of(t.storage(), device_), t.storage(),
                           t.storage().data(), t.storage().nbytes()});
      s = &storages_.back();
    }
    return openreg_tensor_over(s->openreg, t);
  }

  c10::IValue result(const c10::IValue& value) {
    if (value.isTensor()) return result(value.toTensor());
    if (value.isTensorList()) {
      c10::List<Tensor> list;
      for (const Tensor& t : value.toTensorVector()) list.push_back(result(t));
      return list;
    }
    return value;
  }

  // Whether a result of a view op aliases an argument (a CPU kernel's views always do).
  bool aliases_argument(const c10::IValue& value) const {
    for (const Tensor& t : tensors_of(value)) {
      if (t.defined() && t.is_cpu() && find(t.storage()) == nullptr) return false;
    }
    return true;
  }

 private:
  struct Storage {
    c10::Storage openreg;
    c10::Storage cpu;
    const void* data;  // of both, before the call
    size_t nbytes;
  };
  struct TensorAlias {
    Tensor openreg;
    Tensor cpu;
    bool written;
  };

  const Storage& storage_alias(const c10::Storage& openreg) {
    for (const Storage& s : storages_) {
      if (s.openreg.unsafeGetStorageImpl() == openreg.unsafeGetStorageImpl()) return s;
    }
    storages_.push_back({openreg, cpu_storage_over(openreg), openreg.data(), openreg.nbytes()});
    return storages_.back();
  }

  const Storage* find(const c10::Storage& cpu) const {
    for (const Storage& s : storages_) {
      if (s.cpu.unsafeGetStorageImpl() == cpu.unsafeGetStorageImpl()) return &s;
    }
    return nullptr;
  }

  c10::DeviceIndex device_;
  std::deque<Storage> storages_;  // stable addresses
  std::vector<TensorAlias> tensors_;
};

bool is_word_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_';
}

// The message with the words "cpu"/"CPU" (the device the CPU kernel saw) replaced by "openreg".
std::string naming_openreg(const std::string& message) {
  std::string out;
  for (size_t i = 0; i < message.size();) {
    const bool word_start = i == 0 || !is_word_char(message[i - 1]);
    const bool cpu_word =
        word_start && i + 3 <= message.size() &&
        (message.compare(i, 3, "cpu") == 0 || message.compare(i, 3, "CPU") == 0) &&
        (i + 3 == message.size() || !is_word_char(message[i + 3]));
    if (cpu_word) {
      out += "openreg";
      i += 3;
    } else {
      out += message[i++];
    }
  }
  return out;
}

// Rethrows a CPU kernel's error, of the same kind, naming openreg where it named the CPU.
[[noreturn]] void rethrow_naming_openreg(const c10::Error& e) {
  const std::string message = naming_openreg(e.msg());
  if (message == e.msg()) throw;
  const c10::SourceLocation where{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  if (dynamic_cast<const c10::IndexError*>(&e)) throw c10::IndexError(where, message);
  if (dynamic_cast<const c10::ValueError*>(&e)) throw c10::ValueError(where, message);
  if (dynamic_cast<const c10::TypeError*>(&e)) throw c10::TypeError(where, message);
  if (dynamic_cast<const c10::NotImplementedError*>(&e))
    throw c10::NotImplementedError(where, message);
  if (dynamic_cast<const c10::LinAlgError*>(&e)) throw c10::LinAlgError(where, message);
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) throw;
  throw c10::Error(where, message);
}

}  // namespace

void run_on_cpu(const c10::OperatorHandle& cpu_op, torch::jit::Stack* stack) {
  const auto& schema = cpu_op.schema();
  const auto& arguments = schema.arguments();
  const size_t first = stack->size() - arguments.size();
  check_one_device(cpu_op, *stack, first);
  c10::DeviceIndex target = device_of_arguments(*stack, first);
  // A device argument (factories) names the results' device; the CPU kernel gets the CPU.
  for (size_t i = first; i < stack->size(); ++i) {
    c10::IValue& value = (*stack)[i];
    if (!value.isDevice() || value.toDevice().type() != kDeviceType) continue;
    if (target < 0) target = checked_index(value.toDevice().index());
    value = c10::IValue(c10::Device(c10::kCPU));
  }
  // Syncing the op's device's current stream orders the CPU kernel after the work queued there,
  // on its inputs or not (an output written by an earlier asynchronous copy, say). An op without
  // openreg tensors runs on the current device.
  const c10::DeviceIndex device = target >= 0 ? target : current_device();
  OR_CHECK(orStreamSynchronize(current_stream(device)));

  Aliases aliases(device);
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::AliasInfo* alias = arguments[i].alias_info();
    c10::IValue& value = (*stack)[first + i];
    value = aliases.alias(value, alias != nullptr && alias->isWrite());
  }
  {
    const GeneratorLoan loan(cpu_op, *stack, device);
    std::optional<CpuKernelAllocations> on_device;
    if (target >= 0) on_device.emplace(target);
    try {
      cpu_op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    } catch (const c10::Error& e) {
      if (target < 0) throw;
      rethrow_naming_openreg(e);
    }
  }
  aliases.write_back();
  if (target < 0) return;  // nothing on openreg: the results stay where the CPU kernel made them

  const auto& returns = schema.returns();
  const size_t returns_begin = stack->size() - returns.size();
  for (size_t i = 0; i < returns.size(); ++i) {
    c10::IValue& value = (*stack)[returns_begin + i];
    const c10::AliasInfo* alias = returns[i].alias_info();
    // A view must alias its base: CPU view kernels always do, which is checked all the same.
    TORCH_CHECK(alias == nullptr || aliases.aliases_argument(value), "openreg: the operator ",
                schema.operator_name(),
                " is a view operator but its CPU kernel returned new memory");
    value = aliases.result(value);
  }
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_on_cpu(op, stack);
}

// PrivateUse1 convolutions reach convolution_overrideable, whose arguments are convolution's:
// the CPU's convolution runs on the aliases.
void convolution_overrideable(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  static const c10::OperatorHandle convolution =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  run_on_cpu(convolution, stack);
}

// convolution_backward takes bias_sizes (after weight) too: the bias has one value per output
// channel.
void convolution_backward_overrideable(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const c10::OperatorHandle backward =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution_backward", "");
  const size_t first = stack->size() - op.schema().arguments().size();
  const Tensor weight = (*stack)[first + 2].toTensor();
  const bool transposed = (*stack)[first + 6].toBool();
  const int64_t groups = (*stack)[first + 8].toInt();
  const int64_t channels = transposed ? weight.size(1) * groups : weight.size(0);
  stack->insert(stack->begin() + static_cast<std::ptrdiff_t>(first + 3),
                c10::IValue(std::vector<int64_t>{channels}));
  run_on_cpu(backward, stack);
}

}  // namespace devipc::openreg
