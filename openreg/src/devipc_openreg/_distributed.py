"""torch.distributed on openreg: the process-group backend "oreg", registered the way vendors
register theirs (`Backend.register_backend(..., devices=[...])`, as Ascend does hccl), so that
`init_process_group("oreg")`, `"cpu:gloo,openreg:oreg"` and, on a machine whose accelerator is
openreg, a plain `init_process_group()` pick it, as they pick nccl for cuda.

Why it rides on gloo: openreg's device memory is host memory, so a CPU tensor can alias an openreg
tensor's pages without a copy; gloo then moves the bytes between processes (over loopback) and
writes results straight into the openreg memory. What openreg adds is the device's part of the
contract: each call first waits for the work queued on the current stream of the devices it
touches (inputs are final, outputs are no longer in use), keeps those tensors alive until its work
completes, and refuses what it cannot serve with an error that names openreg. It is a Python
`ProcessGroup` subclass because torch's C++ `Backend` cannot be subclassed from Python; torch then
uses the group as is for every device.
"""

from __future__ import annotations

import ctypes
import datetime
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import _device

if TYPE_CHECKING:
    from torch._C._distributed_c10d import AllgatherOptions

BACKEND = "oreg"
_DEVICES = ["openreg", "cpu"]  # cpu tensors (object collectives, barrier) go to gloo as they are
_AVG, _SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM
_Options = TypeVar("_Options", bound=dist.AllreduceOptions)


def register() -> None:
    """Makes "oreg" a torch.distributed backend and openreg's default one; idempotent. Without
    gloo in this torch build there is nothing to build on, and "oreg" stays unknown."""
    if dist.is_gloo_available() and BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=_DEVICES)


def _create(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
) -> OpenRegProcessGroup:
    return OpenRegProcessGroup(store, rank, size, timeout)


def _host_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same pages as the openreg `tensor`: same dtype, shape, strides and
    offset. The alias holds `tensor`, so the memory stays valid for as long as gloo holds it."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    pages = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    pages.owner = tensor  # type: ignore[attr-defined]
    flat = torch.frombuffer(pages, dtype=torch.uint8).view(tensor.dtype)
    return flat.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


class _Prepared:
    """The arguments of one call with every openreg tensor replaced by its host alias, after the
    work queued on the current streams of their devices is done."""

    def __init__(self, what: str, args: tuple[object, ...]) -> None:
        self.what = what
        # id(alias): (alias, openreg tensor), for the work's future
        self.originals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        devices: set[int] = set()
        for arg in args:
            self._check(arg, devices)
        for index in sorted(devices):
            _device.current_stream(index).synchronize()
        self.args = [self._alias(arg) for arg in args]

    def _check(self, arg: object, devices: set[int]) -> None:
        """Checks the tensors of `arg` (a tensor or nested lists of them); other values pass."""
        if isinstance(arg, (list, tuple)):
            for a in arg:
                self._check(a, devices)
            return
        if not isinstance(arg, torch.Tensor):
            return
        if arg.device.type not in _DEVICES:
            raise ValueError(
                f"the {BACKEND!r} process group serves openreg and cpu tensors; "
                f"{self.what} got a tensor on {arg.device}"
            )
        if arg.layout != torch.strided or arg.is_conj() or arg.is_neg():
            raise ValueError(
                f"the {BACKEND!r} process group needs dense tensors without conj/neg "
                f"bits; {self.what} got a {arg.layout} one (conj {arg.is_conj()}, "
                f"neg {arg.is_neg()})"
            )
        if arg.device.type == "openreg":
            devices.add(arg.device.index)

    def _alias(self, arg: object) -> object:
        if isinstance(arg, (list, tuple)):
            return [self._alias(a) for a in arg]
        if isinstance(arg, torch.Tensor) and arg.device.type == "openreg":
            alias = _host_alias(arg)
            self.originals[id(alias)] = (alias, arg)
            return alias
        return arg

    def restore(self, value: object) -> object:
        """`value` (a future's result) with each alias of ours replaced by its openreg tensor."""
        if isinstance(value, (list, tuple)):
            return [self.restore(v) for v in value]
        if isinstance(value, torch.Tensor) and id(value) in self.originals:
            return self.originals[id(value)][1]
        return value


class _Work(dist.Work):
    """gloo's work on the aliases; its errors and its future's result speak of openreg."""

    def __init__(self, inner: dist.Work, prepared: _Prepared) -> None:
        super().__init__()
        self._inner = inner
        self._prepared = prepared

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        try:
            return self._inner.wait() if timeout is None else self._inner.wait(timeout)
        except RuntimeError as e:
            raise RuntimeError(
                f"{self._prepared.what} on the {BACKEND!r} (openreg) process group: {e}"
            ) from e

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def get_future(self) -> torch.futures.Future[object]:
        prepared = self._prepared
        return self._inner.get_future().then(lambda done: prepared.restore(done.value()))


class OpenRegProcessGroup(dist.ProcessGroup):
    """A process group whose collectives and point-to-point ops take openreg (or cpu) tensors."""

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        store = dist.PrefixStore(f"{BACKEND}/gloo/", store)
        self._gloo: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:  # the name torch's C++ asks for
        return BACKEND

    def _run(self, what: str, gloo_method: str, *args: object) -> _Work:
        if self._gloo is None:
            raise RuntimeError(f"{what}: this {BACKEND!r} process group was shut down")
        prepared = _Prepared(what, args)
        try:
            inner = getattr(self._gloo, gloo_method)(*prepared.args)
        except RuntimeError as e:
            raise RuntimeError(f"{what} on the {BACKEND!r} (openreg) process group: {e}") from e
        return _Work(inner, prepared)

    def _reduce_op(
        self, what: str, tensors: list[torch.Tensor], opts: _Options, options_type: type[_Options]
    ) -> _Options:
        """`opts` as gloo can serve it: gloo has no AVG, so each share is divided by the group
        size here and the shares are summed."""
        if opts.reduceOp != _AVG:  # gloo refuses what it cannot do (PREMUL_SUM) by itself
            return opts
        if not all(t.is_floating_point() or t.is_complex() for t in tensors):
            raise TypeError(
                f"{what} with AVG on the {BACKEND!r} process group needs floating "
                f"point or complex tensors"
            )
        for t in tensors:
            t.div_(self.size())
        summed = options_type()
        summed.reduceOp, summed.timeout = _SUM, opts.timeout  # type: ignore[assignment]
        return summed

    # ---- collectives ----
    def allreduce(  # type: ignore[override]
        self,
        tensors: list[torch.Tensor],
        opts: dist.AllreduceOptions | None = None,
    ) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        opts = self._reduce_op("all_reduce", tensors, opts, dist.AllreduceOptions)
        return self._run("all_reduce", "allreduce", tensors, opts)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceCoalescedOptions | None = None
    ) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        opts = self._reduce_op(
            "all_reduce_coalesced", tensors, opts, dist.AllreduceCoalescedOptions
        )
        return self._run("all_reduce_coalesced", "allreduce_coalesced", tensors, opts)

    def broadcast(  # type: ignore[override]
        self,
        tensors: list[torch.Tensor],
        opts: dist.BroadcastOptions | None = None,
    ) -> dist.Work:
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._run("broadcast", "broadcast", tensors, opts)

    def reduce(  # type: ignore[override]
        self,
        tensors: list[torch.Tensor],
        opts: dist.ReduceOptions,
    ) -> dist.Work:
        if opts.reduceOp == _AVG:
            raise ValueError(
                f"reduce on the {BACKEND!r} process group does not support AVG "
                f"(only all_reduce does)"
            )
        return self._run("reduce", "reduce", tensors, opts)

    def allgather(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._run("all_gather", "allgather", output_lists, inputs, opts)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._run("all_gather_single", "_allgather_base", output, input, opts)

    _allgather_base = all_gather_single

    def reduce_scatter(  # type: ignore[override]
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: dist.ReduceScatterOptions | None = None,
    ) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run("reduce_scatter", "reduce_scatter", outputs, input_lists, opts)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        opts: dist.ReduceScatterOptions | None = None,
    ) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run("reduce_scatter_single", "_reduce_scatter_base", output, input, opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def gather(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: dist.GatherOptions,
    ) -> dist.Work:
        return self._run("gather", "gather", output_lists, inputs, opts)

    def scatter(  # type: ignore[override]
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: dist.ScatterOptions,
    ) -> dist.Work:
        return self._run("scatter", "scatter", outputs, input_lists, opts)

    def alltoall(  # type: ignore[override]
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: dist.AllToAllOptions | None = None,
    ) -> dist.Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._run("all_to_all", "alltoall", outputs, inputs, opts)

    def all_to_all_single(  # type: ignore[override]
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: dist.AllToAllOptions | None = None,
    ) -> dist.Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._run(
            "all_to_all_single", "alltoall_base", output, input, output_splits, input_splits, opts
        )

    def barrier(  # type: ignore[override]
        self,
        opts: dist.BarrierOptions | None = None,
    ) -> dist.Work:
        return self._run("barrier", "barrier", dist.BarrierOptions())

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._run("all_gather_coalesced", "allgather_coalesced", output_lists, inputs, opts)

    def _unsupported(self, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"the {BACKEND!r} (openreg) process group does not coalesce collectives; issue "
            f"them one by one"
        )

    _start_coalescing = _end_coalescing = _unsupported
    all_gather_single_coalesced = reduce_scatter_single_coalesced = _unsupported

    # ---- point to point ----
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._run("send", "send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._run("recv", "recv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._run("recv", "recv_anysource", tensors, tag)

    # ---- life cycle ----
    def shutdown(self) -> None:
        """Closes gloo's connections now, not whenever the group object is collected."""
        gloo, self._gloo = self._gloo, None
        if gloo is not None:
            gloo.shutdown()

    abort = shutdown
