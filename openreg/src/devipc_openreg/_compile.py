"""torch.compile on openreg: dynamo's DeviceInterface and inductor's backend for the device.

openreg memory is host memory, so inductor's CPU C++ code generation serves it: kernels take raw
pointers, which for openreg are host addresses. The Python wrapper allocates buffers on the
kernel's openreg device and synchronizes that device's current stream before each C++ kernel, as
work queued there earlier (an asynchronous copy, say) may still be writing what the kernel reads.
Inductor knows C++ kernels by the device type "cpu"; `_as_cpp` extends that to openreg.

Both registrations wait for first need, since importing dynamo takes seconds: the DeviceInterface
is registered as soon as `torch._dynamo.device_interface` has been imported, the inductor backend
when inductor first asks `torch.openreg` for its `Scheduling` (`init_backend_registration`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections import namedtuple
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from . import _device

if TYPE_CHECKING:
    from torch._inductor import ir
    from torch._inductor.virtualized import _V

_NAME = "openreg"
_DEVICE_INTERFACE = "torch._dynamo.device_interface"
_INDUCTOR_HOOKS = ("Scheduling", "PythonWrapperCodegen", "CppWrapperCodegen", "WrapperFxCodegen")
_Properties = namedtuple("_Properties", ["name", "multi_processor_count"])
_worker_device: int | None = None  # set by DeviceInterface.Worker.set_device


def register() -> None:
    """Makes dynamo and inductor know openreg, each when it is loaded or asks (idempotent)."""
    if _DEVICE_INTERFACE in sys.modules:
        _register_interface(sys.modules[_DEVICE_INTERFACE])
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    fallback = vars(_device).get("__getattr__")
    if fallback is None or not hasattr(fallback, "inductor_hooks"):
        _device.__getattr__ = _inductor_hook(fallback)  # module __getattr__: for names it lacks
    common = sys.modules.get("torch._inductor.codegen.common")
    if common is not None:  # inductor may have set up its backends already, without openreg
        common.register_backend_for_device(_NAME, *_inductor_backend())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers the DeviceInterface right after dynamo's device_interface module has run, before
    anything can look a device up there; then leaves sys.meta_path."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DEVICE_INTERFACE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None  # left to the other finders; this one stays, harmless
        sys.meta_path.remove(self)  # the import stops at the spec returned: safe to remove
        exec_module = spec.loader.exec_module

        def exec_and_register(module: types.ModuleType) -> None:
            exec_module(module)
            _register_interface(module)

        spec.loader.exec_module = exec_and_register  # type: ignore[method-assign]
        return spec


def _register_interface(module: types.ModuleType) -> None:
    module.register_interface_for_device(_NAME, _interface(module.DeviceInterface))


def _exchange_device(index: int) -> int:
    """Makes `index` current unless it is negative; returns the device that was current."""
    previous = _device.current_device()
    if index >= 0 and index != previous:
        _device.set_device(index)
    return previous


def _interface(base: type) -> type:
    """openreg's DeviceInterface: torch.openreg's functions under the names dynamo calls."""

    class OpenRegInterface(base):
        device = _device.device
        Stream = torch.Stream
        Event = torch.Event

        class Worker:
            """For inductor's compile workers: no device call once a device is set."""

            @staticmethod
            def set_device(device: int) -> None:
                global _worker_device
                _worker_device = device

            @staticmethod
            def current_device() -> int:
                return _device.current_device() if _worker_device is None else _worker_device

            @staticmethod
            def get_device_properties(
                device: torch.device | str | int | None = None,
            ) -> _Properties:
                return _Properties(_NAME, os.cpu_count() or 1)  # the host's CPUs run kernels

        current_device = staticmethod(_device.current_device)
        set_device = staticmethod(_device.set_device)
        device_count = staticmethod(_device.device_count)
        is_available = staticmethod(_device.is_available)
        synchronize = staticmethod(_device.synchronize)
        current_stream = staticmethod(_device.current_stream)
        memory_allocated = staticmethod(_device.memory_allocated)
        exchange_device = staticmethod(_exchange_device)
        maybe_exchange_device = staticmethod(_exchange_device)

        @staticmethod
        def get_raw_stream(device_idx: int) -> int:
            return 0  # kernels run on the host, after the wrapper synchronized the stream

        @staticmethod
        def get_compute_capability(device: torch.device | str | int | None = None) -> str:
            return ""

        @staticmethod
        def is_bf16_supported(including_emulation: bool = False) -> bool:
            return True

    return OpenRegInterface


def _inductor_hook(fallback: Callable[[str], Any] | None) -> Callable[[str], Any]:
    """torch.openreg's `__getattr__`, answering the names inductor looks up there
    (`_get_custom_mod_func`) by importing inductor's code generators; `fallback` answers the
    others."""

    def module_getattr(name: str) -> Any:
        if name in _INDUCTOR_HOOKS:
            return _inductor_backend()[_INDUCTOR_HOOKS.index(name)]
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module 'torch.openreg' has no attribute {name!r}")

    module_getattr.inductor_hooks = _INDUCTOR_HOOKS  # type: ignore[attr-defined]
    return module_getattr


def _refused(wrapper: str) -> type:
    """A wrapper codegen that refuses by name: inductor's C++ and FX wrappers would have to order
    kernels after openreg's stream themselves, which is not provided."""

    class Refused:
        supports_caching = False  # read before create()

        @staticmethod
        def create(*args: object, **kwargs: object) -> NoReturn:
            raise NotImplementedError(
                f"torch.compile on openreg generates inductor's Python wrapper only; {wrapper} is "
                f"not supported for openreg"
            )

    return Refused


@functools.cache
def _inductor_backend() -> tuple[type, type, type, type]:
    """(scheduling, Python wrapper, C++ wrapper, FX wrapper) of openreg. Also registers its
    device op overrides and makes inductor generate openreg's kernels as C++ (`_as_cpp`)."""
    from torch._inductor.codegen import common, cpu_device_op_overrides, wrapper
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.virtualized import V

    _as_cpp(V)

    class DeviceOps(cpu_device_op_overrides.CpuDeviceOpOverrides):
        def set_device(self, device_idx: int) -> str:
            return f"torch.openreg.set_device({device_idx})"

        def synchronize(self) -> str:
            return "torch.openreg.synchronize()"

        def device_guard(self, device_idx: int) -> str:
            return f"torch.openreg.device({device_idx})"

    class OpenRegCalls:
        """What the Python wrapper does differently for openreg."""

        def make_allocation(
            self, name: str, device: torch.device, *args: Any, **kwargs: Any
        ) -> str:
            # Inductor sets the current device around kernels of GPUs only: name the index, or
            # buffers of openreg:1 would land on the current device.
            line = super().make_allocation(name, device, *args, **kwargs)  # type: ignore[misc]
            if device.type == _NAME and device.index is not None:
                line = line.replace(f"device='{_NAME}'", f"device='{device}'")
            return line

        def _generate_kernel_call_helper(
            self,
            kernel_name: str,
            call_args: list[str],
            *,
            device: torch.device | None = None,
            triton: bool = True,
            **kwargs: Any,
        ) -> None:
            device = device or V.graph.get_current_device_or_throw()
            if device.type != _NAME or triton:
                return super()._generate_kernel_call_helper(  # type: ignore[misc]
                    kernel_name, call_args, device=device, triton=triton, **kwargs
                )
            index = "" if device.index is None else device.index
            synchronize = f"torch.openreg.current_stream({index}).synchronize()"
            self.writeline(synchronize)  # type: ignore[attr-defined]
            self.writeline(self.wrap_kernel_call(kernel_name, call_args))  # type: ignore[attr-defined]

    class SubgraphWrapper(OpenRegCalls, wrapper.SubgraphPythonWrapperCodegen):
        pass

    class Wrapper(OpenRegCalls, wrapper.PythonWrapperCodegen):
        @staticmethod
        def create(
            is_subgraph: bool,
            subgraph_name: str | None,
            parent_wrapper: wrapper.PythonWrapperCodegen | None,
            partition_signatures: ir.GraphPartitionSignature | None = None,
        ) -> wrapper.PythonWrapperCodegen:
            if is_subgraph:
                return SubgraphWrapper(subgraph_name, parent_wrapper, partition_signatures)  # type: ignore[arg-type]
            return Wrapper()

    common.register_device_op_overrides(_NAME, DeviceOps())
    return (
        CppScheduling,
        Wrapper,
        _refused("the C++ wrapper (torch._inductor.config.cpp_wrapper, AOTInductor)"),
        _refused("the FX wrapper (torch._inductor.config.fx_wrapper)"),
    )


def _as_cpp(V: _V) -> None:
    """Inductor 2.13 chooses C++ code generation by the device type "cpu" in two places that
    openreg's kernels pass through: which backend generates a kernel (else it takes the Triton
    path and fails on C++ kernels: masked loads, integer ops) and which nodes skip the loop
    reorderings C++ generation does not support (else fusion fails). Both learn that openreg's
    kernels are C++ too; every other device keeps inductor's answer."""
    from torch._inductor import scheduler, utils
    from torch._inductor.codegen import common

    backend_of = utils.get_current_backend
    is_cpu = scheduler.BaseSchedulerNode.is_cpu

    def get_current_backend(device_type: str | None = None) -> str:
        if (device_type or V.graph.get_current_device_or_throw().type) == _NAME:
            return "cpp"
        return backend_of(device_type)

    def node_is_cpu(node: scheduler.BaseSchedulerNode) -> bool:
        device = node.get_device()
        return is_cpu(node) or (device is not None and device.type == _NAME)

    for module in (utils, common, scheduler):  # each bound the name at import
        module.get_current_backend = get_current_backend  # type: ignore[attr-defined]
    scheduler.BaseSchedulerNode.is_cpu = node_is_cpu  # type: ignore[method-assign, assignment]
