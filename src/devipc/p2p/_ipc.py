"""devipc.p2p's same-host path (`Endpoint(transport="ipc")`, the default): the device's IPC
hooks and devipc's core. The owner's side (`_export`) hands out the export of a registration's
storage; a peer (`_remote`) maps it once per registration and copies with the device's own copy
path (one `copy_batch` call where the hooks have it), host memory by memmove.

What does not change between calls is kept: the link keeps the plan of a copy it made before,
one small descriptor copied by the calling thread (`_SinglePlan`) or a vector batched on the
device (`_BatchPlan`), and a prepared transfer holds all of it (`IpcPrepared`, `_PreparedPlan`);
a call then checks the registrations' words and the local tensors only. One small copy of
memory the CPU may address ("DRAM" hooks), when the current stream is idle, is made by the
calling thread: handing it to the stream and waiting for it would cost more than the copy, and
the order is the same.
"""

import array
import ctypes
import operator
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, cast

import torch

from .._core._copies import copy_table
from .._core._devices import accelerator_index, accelerator_streams
from .._core._errors import NotRegisteredError, TransferSizeError, UnsupportedDeviceError
from .._core._hooks import hooks_for
from .._core._host import host_addressable
from .._core._sharing import wait_for_producer
from ._descriptor import CPU, DEVICE, Descriptor, Metadata, host_identity
from ._export import CpuExport, DeviceExport, export_of, order_for_peers
from ._registry import Registration
from ._remote import Peer, RemoteEntry, host_bytes
from ._transfer import DONE, Transfer, record_events, run_on_host
from ._transport import READ

__all__ = ["IpcLink", "IpcPrepared", "IpcTransport"]

_BATCH_MIN = 2  # pairs from which a post hands the device one batch (hooks' copy_batch)
_INLINE_PAIRS = 1  # pairs the calling thread may copy itself (vectors: one batch of the device)
_INLINE_BYTES = 1 << 20  # ... and, for a prepared post (asynchronous), at most this many bytes
_SWEEP_EVERY = 64  # such copies between two sweeps of the registrations the owner ended
_PAIRS_KEPT = 1 << 16  # pairs of the plans a link keeps (singles and vectors together)
_SLICE = 256  # pairs: a vector posted again goes to the device in slices of this many
_CPU = torch.device("cpu")
_contiguous, _address = torch.Tensor.is_contiguous, torch.Tensor.data_ptr
_device_of = operator.attrgetter("device")
_Kept = TypeVar("_Kept", "_SinglePlan", "_BatchPlan")


class IpcTransport:
    """The same-host transport: descriptors carry the memory's IPC handles."""

    name = "ipc"

    def metadata(self) -> bytes:
        return b""

    def describe(self, reg: Registration, offset: int, nbytes: int) -> dict:
        export = export_of(reg)
        if export is None or not reg.alive:
            raise NotRegisteredError(f"tensor id {reg.id} is not registered any more")
        if reg.device.type == "cpu":
            assert isinstance(export, CpuExport)  # export_of: a CPU storage's export
            where: dict = dict(kind=CPU, fd=export.fd, anchor=export.inode)
        else:
            assert isinstance(export, DeviceExport)
            where = dict(
                kind=DEVICE,
                mem=export.mem,
                mem_offset=export.mem_offset,
                counter=export.counter,
                anchor=export.anchor,
            )
        where["event"] = order_for_peers(reg.device)
        return where

    def connect(self, meta: Metadata) -> "IpcLink":
        if meta.host != host_identity() or not meta.host:
            raise UnsupportedDeviceError(
                f"peer process {meta.pid} runs on another host or PID namespace: the device's "
                f"IPC hooks cannot reach its memory. Use Endpoint(transport='nixl') on both sides"
            )
        return IpcLink(Peer(meta))

    def close(self) -> None:
        pass


class IpcLink:
    """One peer's mapped registrations, and the copies into and out of them."""

    sub_ranges = True  # the copies address `desc.offset` in the mapping of the whole storage

    def __init__(self, peer: Peer):
        self._peer = peer
        self._posts = 0  # copies made in the calling thread, which sweep only now and then
        # the plans of copies made before: one descriptor's by its id, a vector's by its ids
        self._singles: dict[int, _SinglePlan] = {}
        self._batches: dict[tuple[int, ...], _BatchPlan] = {}
        self._planned = 0  # pairs the plans hold, for _PAIRS_KEPT
        self._last: _BatchPlan | None = None  # the last vector's: found by its list

    def mapped(self) -> int:
        return self._peer.mapped()

    def close(self) -> None:
        self._peer.close()

    def map(self, desc: Descriptor) -> torch.Tensor:
        self._peer.check_alive()
        return self._peer.map(desc)

    def prepare(self, op: str, locals_: list, descs: list) -> "IpcPrepared":
        return IpcPrepared(self._peer, op, locals_, descs)

    def post(self, op: str, locals_: list, descs: list, wait: bool) -> Transfer:
        """The copies by the plan of an earlier post of these descriptors, where one is kept and
        still holds; else by the full path, which keeps a plan for the next post."""
        self._peer.check_alive()
        if len(descs) == 1:
            if wait and self.again(op, locals_[0], descs[0]):
                return DONE
        elif descs:
            plan = self._last  # a connection hands a known vector's list again
            if plan is None or plan.descs is not descs:
                plan = self._last = self._batches.get(tuple(map(id, descs)))
            transfer = None if plan is None else plan.batch_again(op, locals_, self._peer)
            if transfer is not None:
                if wait:
                    transfer.wait()
                return transfer
        return self._post(op, locals_, descs, wait)

    def again(self, op: str, local: torch.Tensor, desc: Descriptor) -> bool:
        """A synchronous copy of one whole descriptor by the calling thread, by the plan of an
        earlier one: whether it was made (not without a plan, if `local` is strided, on a device
        the CPU may not address, a stream is busy or the registration ended), else the caller's
        path (`post`) says why not. The connection's shortcut for its `read` and `write`."""
        plan = self._singles.get(id(desc))
        if plan is None or not local.is_contiguous():
            return False
        device, index = plan.device, plan.stream
        if local.is_cpu:
            if index >= 0 and not _current_stream(index).query():
                return False
        else:
            here = local.device
            if here == device:
                if not _current_stream(index).query():
                    return False
            elif not host_addressable(here) or not _idle(
                (here,) if device is None else (here, device)
            ):
                return False
        address = local.data_ptr()
        last_address, mine = plan.last
        if address != last_address or mine is None:
            mine = host_bytes(address, desc.nbytes)
            plan.last = (address, mine)
        # False once the registration ended: the caller's path says why
        if op == READ:
            return self._peer.copy_live(plan.entries[0], mine, plan.remote)
        return self._peer.copy_live(plan.entries[0], plan.remote, mine)

    def _post(self, op: str, locals_: list, descs: list, wait: bool) -> Transfer:
        """The full path: every registration opened (or found) and pinned, every pair checked."""
        peer = self._peer
        peer.sweep()  # the registrations the owner ended: their mappings go
        entries = peer.open_all(descs)  # pinned: no other thread unmaps them under the copies
        try:
            if (
                wait
                and len(descs) <= _INLINE_PAIRS
                and self._copied_here(op, locals_, entries, descs)
            ):
                return DONE
            distinct = list({id(entry): entry for entry in entries}.values())  # few, many
            devices = {entry.device for entry in distinct if entry.device.type != "cpu"}
            devices.update(local.device for local in locals_ if not local.is_cpu)
            batch = _batch(op, locals_, entries, descs, devices)
            pairs: list = (
                []
                if batch is not None
                else [
                    _pair(op, local, entry, desc)
                    for local, entry, desc in zip(locals_, entries, descs)
                ]
            )
            if not devices and not wait:  # the job off this thread unpins them
                pinned, entries = entries, []
                return self._on_host(pairs, pinned, locals_)
            if devices:
                _wait_for_owner(entries, descs, devices)
            return self._queue(op, descs, distinct, devices, batch, pairs, locals_)
        finally:
            peer.unpin(entries)

    def _copied_here(self, op: str, locals_: list, entries: list[RemoteEntry], descs: list) -> bool:
        """Whether the calling thread copied these few pairs itself (host-addressable memory,
        idle streams); it then keeps one descriptor's plan."""
        rows = _host_rows(op, locals_, entries, descs)
        if rows is None or not _idle(rows[1]):
            return False
        _move(rows[0])
        if len(descs) == 1 and descs[0].nbytes <= _INLINE_BYTES:
            entry, desc = entries[0], descs[0]
            device = None if entry.device.type == "cpu" else entry.device
            assert entry.address is not None  # `_host_rows` took it
            stream = None if device is None else accelerator_index(device)
            self._keep(
                self._singles,
                id(desc),
                _SinglePlan(
                    descs=[desc],
                    entries=[entry],
                    device=device,
                    stream=-1 if stream is None else stream,
                    remote=host_bytes(entry.address + desc.offset, desc.nbytes),
                ),
            )
        self._posts += 1
        if not self._posts % _SWEEP_EVERY:  # now and then: plans never sweep
            self._peer.sweep()
        return True

    def _queue(
        self,
        op: str,
        descs: list,
        distinct: list[RemoteEntry],
        devices: set,
        batch: "_Batch | None",
        pairs: list,
        locals_: list,
    ) -> Transfer:
        """The copies queued on the devices' current streams (or made here, host memory)."""
        try:
            if batch is None:
                _copy(pairs)
            else:
                batch.copy_batch(batch.device_index, batch.table)
                (device,) = devices
                remote = 1 if op == READ else 0  # the table's column of the peer's addresses
                self._last = self._keep(
                    self._batches,
                    tuple(map(id, descs)),
                    _BatchPlan(
                        descs=descs,
                        entries=distinct,
                        device=device,
                        table=batch.table[:, [remote, 2]].t().contiguous(),
                        cpu_remote=any(entry.device.type == "cpu" for entry in distinct),
                    ),
                )
            remote_data = [entry.data for entry in distinct]  # kept: they outlive the copies
            transfer = Transfer(record_events(devices), keep=(pairs, batch, remote_data, locals_))
            if any(entry.device.type == "cpu" for entry in distinct):
                transfer.wait()  # a CPU mapping must outlive the device copy: finish it here
        except BaseException:
            if devices:  # copies queued before the error end before their pins go
                Transfer(record_events(devices)).wait()
            raise
        return transfer

    def _keep(self, plans: dict, key: int | tuple[int, ...], plan: _Kept) -> _Kept:
        """Keep `plan` in `plans` for the next post of its descriptors (all dropped past
        _PAIRS_KEPT)."""
        self._planned += len(plan.descs)
        if self._planned > _PAIRS_KEPT:
            self._singles.clear()
            self._batches.clear()
            self._planned, self._last = len(plan.descs), None
        plans[key] = plan
        return plan

    def _on_host(
        self, pairs: Iterable[tuple], entries: list[RemoteEntry], locals_: list[torch.Tensor]
    ) -> Transfer:
        """Host copies off the calling thread (the async calls). The job holds the local tensors:
        the pairs may be bare addresses."""
        peer = self._peer

        def copy() -> None:
            try:
                _copy(pairs)
            finally:
                peer.unpin(entries)
                locals_.clear()

        try:
            return Transfer(future=run_on_host(copy))
        except BaseException:
            peer.unpin(entries)
            raise


# A same-host copy of some descriptors as the full path validated it is kept in one of three
# plans: by the link for the next copy of the same descriptors (`_SinglePlan`, `_BatchPlan`) or
# by a prepared transfer (`_PreparedPlan`). Only the local tensors (not a prepared one's: they
# are fixed) and the registrations' words are read again. Each holds its descriptors (their ids,
# the link's key for the plan, stay theirs) and the distinct registrations its copies reach.


@dataclass(slots=True, eq=False)
class _SinglePlan:
    """The link's plan of one descriptor of at most _INLINE_BYTES that the calling thread
    copied itself, made again while the streams that order it are idle (`IpcLink.again`)."""

    descs: list[Descriptor]
    entries: list[RemoteEntry]
    device: torch.device | None  # the device whose current stream orders it (None: host memory)
    stream: int  # its index for the accelerator's current stream, or -1
    remote: memoryview  # the remote range's bytes
    last: tuple[int, memoryview | None] = (0, None)  # the last local address, and its bytes


@dataclass(slots=True, eq=False)
class _BatchPlan:
    """The link's plan of a vector the device copied as one batch, handed to the device again
    in slices (`batch_again`)."""

    descs: list[Descriptor]
    entries: list[RemoteEntry]
    device: torch.device  # the device whose current stream orders the copies
    table: torch.Tensor  # the pairs' remote addresses, then their bytes
    cpu_remote: bool  # the peer's CPU memory reached: a device copy ends before return

    def batch_again(self, op: str, locals_: list, peer: Peer) -> Transfer | None:
        """The batch again with these local tensors; None where the full path must run (a local
        tensor elsewhere or strided, a registration that ended, no `copy_batch`).

        The device gets it in slices of _SLICE pairs: the first slices' copies run on its stream
        while this thread reads the next local tensors' addresses (two cores, not one after the
        other). Every local tensor is checked before any slice goes."""
        device, kept = self.device, self.table
        copy_batch = hooks_for(device).copy_batch
        if (
            copy_batch is None
            or not all(map(_contiguous, locals_))
            or not set(map(_device_of, locals_)) <= {device, _CPU}
        ):
            return None  # (the checks are C loops: map, no Python per pair)
        distinct = self.entries
        if not peer.pin_live(distinct):
            return None
        tables: list[torch.Tensor] = []  # the slices handed to the device
        try:
            for start in range(0, len(locals_), _SLICE):
                end = start + _SLICE
                mine = torch.frombuffer(
                    array.array("q", map(_address, locals_[start:end])), dtype=torch.int64
                )
                remote, sizes = kept[0, start:end], kept[1, start:end]
                table = (
                    copy_table(mine, remote, sizes)
                    if op == READ
                    else copy_table(remote, mine, sizes)
                )
                copy_batch(device.index, table)
                tables.append(table)
            transfer = Transfer(
                record_events((device,)), keep=(tables, [entry.data for entry in distinct], locals_)
            )
            if self.cpu_remote:
                transfer.wait()  # a CPU mapping must outlive the device copy: finish it here
        except BaseException:
            if tables:  # slices went: their copies end before the mappings may go
                Transfer(record_events((device,)), keep=(tables,)).wait()
            raise
        finally:
            peer.unpin(distinct)
        return transfer


@dataclass(slots=True, eq=False)
class _PreparedPlan:
    """A prepared transfer's plan (`prepared`, `post_prepared`), every copy fixed: host bytes
    the calling thread copies while `streams` are idle (`rows`), else the device's batch
    (`batch`) or the pairs (`pairs`)."""

    descs: list[Descriptor]
    entries: list[RemoteEntry]
    devices: set[torch.device]  # the streams ordering the copies
    cpu_remote: bool  # the peer's CPU memory reached: a device copy ends before return
    words: list[tuple[int, int]]  # (slot, id) per registration
    streams: list[int]  # to be idle for `rows`
    rows: list[tuple[memoryview, memoryview]] | None  # (destination, source) host bytes
    batch: "_Batch | None"  # all the copies as one operation of the device
    pairs: list  # else each copy (`_pair`)
    owner: tuple[list[RemoteEntry], list[Descriptor]] | None  # events not waited for yet
    keep: tuple[object, ...]  # what a device copy's Transfer holds until it ends

    @classmethod
    def prepared(
        cls, op: str, locals_: list, entries: list[RemoteEntry], descs: list[Descriptor]
    ) -> "_PreparedPlan":
        """The plan of a prepared transfer: `entries` (one per descriptor, pinned by the caller
        for the plan's life) and `locals_` are fixed."""
        distinct = list({id(entry): entry for entry in entries}.values())
        devices = {entry.device for entry in distinct if entry.device.type != "cpu"}
        devices.update(local.device for local in locals_ if not local.is_cpu)
        rows = _host_rows(op, locals_, entries, descs, events=False)
        streams = [] if rows is None else [accelerator_index(device) for device in rows[1]]
        small = (
            rows is not None
            and None not in streams
            and len(rows[0]) <= _INLINE_PAIRS
            and sum(n for _, _, n in rows[0]) <= _INLINE_BYTES
        )
        batch = _batch(op, locals_, entries, descs, devices)
        return cls(
            descs=descs,
            entries=distinct,
            devices=devices,
            cpu_remote=any(entry.device.type == "cpu" for entry in distinct),
            words=[(entry.slot, entry.reg_id) for entry in distinct],
            # the copies the calling thread may make when these streams are idle
            streams=[index for index in streams if index is not None] if small else [],
            rows=[(host_bytes(dst, n), host_bytes(src, n)) for dst, src, n in rows[0]]
            if rows is not None and small
            else None,
            batch=batch,
            pairs=[]
            if batch is not None
            else [
                _pair(op, local, entry, desc) for local, entry, desc in zip(locals_, entries, descs)
            ],
            owner=(entries, descs) if any(desc.event for desc in descs) else None,
            keep=(locals_, [entry.data for entry in distinct]),
        )

    def post_prepared(self, peer: Peer) -> Transfer:
        """A prepared transfer's copies, once more: the owner's words and the streams read, the
        rest as prepared."""
        devices, owner, rows = self.devices, self.owner, self.rows
        if owner is not None:  # the owner's advertisement events, waited for once
            if rows is not None and all(not d.event or d.event in e.waited for e, d in zip(*owner)):
                self.owner = owner = None
        if (
            rows is not None
            and owner is None
            and _all_idle(self.streams)
            and peer.move_live(self.words, rows)
        ):  # liveness and copies, one lock
            return DONE
        peer.check_alive()
        peer.check_live(self.words)
        if not devices:  # host memory only: copied here (`close` may unmap it afterwards)
            _copy(self.pairs)
            return DONE
        if owner is not None:
            _wait_for_owner(*owner, devices)
            self.owner = None
        batch = self.batch
        if batch is None:
            _copy(self.pairs)
        else:
            batch.copy_batch(batch.device_index, batch.table)
        transfer = Transfer(record_events(devices), keep=self.keep)
        if self.cpu_remote:
            transfer.wait()  # `close` may unmap a CPU mapping: never under a device copy
        return transfer


class IpcPrepared:
    """A transfer validated once (its `_PreparedPlan`): the peer's registrations stay mapped
    and pinned until `close`, and a post checks only the registrations' words."""

    def __init__(self, peer: Peer, op: str, locals_: list, descs: list):
        peer.check_alive()
        entries = peer.open_all(descs)
        try:
            self._plan: _PreparedPlan | None = _PreparedPlan.prepared(op, locals_, entries, descs)
        except BaseException:
            peer.unpin(entries)
            raise
        self._peer, self._entries = peer, entries
        self._lock = threading.Lock()  # a post and `close`: never at once (pins, raw addresses)

    def post(self) -> Transfer:
        with self._lock:
            if self._plan is None:
                raise ValueError("this prepared transfer is closed: prepare it again")
            return self._plan.post_prepared(self._peer)

    def close(self) -> None:
        with self._lock:
            if self._plan is not None:
                self._plan = None
                self._peer.unpin(self._entries)
                self._entries = []


def _host_rows(
    op: str, locals_: list, entries: list[RemoteEntry], descs: list[Descriptor], events: bool = True
) -> tuple[list[tuple[int, int, int]], set] | None:
    """((destination, source, bytes) rows, devices) when every pair is contiguous memory the
    CPU may copy itself (host memory, or a "DRAM" device's) and, with `events`, the owner's
    events were waited for; else None."""
    rows: list[tuple[int, int, int]] = []
    devices = set()
    for local, entry, desc in zip(locals_, entries, descs):
        if (
            entry.address is None
            or (events and desc.event and desc.event not in entry.waited)
            or not local.is_contiguous()
        ):
            return None
        if entry.device.type != "cpu":
            devices.add(entry.device)
        if not local.is_cpu:
            if not host_addressable(local.device):
                return None
            devices.add(local.device)
        here, there = local.data_ptr(), entry.address + desc.offset
        rows.append((here, there, desc.nbytes) if op == READ else (there, here, desc.nbytes))
    return rows, devices


def _idle(devices: Iterable[torch.device]) -> bool:
    """Whether the current stream of each device (the accelerator's) ran all its work: a copy
    the calling thread makes now is then ordered after that work as one queued there would be,
    and without the hand-over to the stream and back (most of a small copy's cost)."""
    indices = [accelerator_index(device) for device in devices]
    return None not in indices and _all_idle(cast(list[int], indices))


def _all_idle(indices: list[int]) -> bool:
    """`_idle` of the devices of these indices (`accelerator_index`)."""
    for index in indices:
        if not _current_stream(index).query():
            return False
    return True


_current_stream = accelerator_streams()  # of an `accelerator_index`: torch's C++ call itself


def _move(rows: Iterable[tuple[int, int, int]]) -> None:
    for dst, src, nbytes in rows:
        ctypes.memmove(dst, src, nbytes)


def _wait_for_owner(
    entries: list[RemoteEntry], descs: list[Descriptor], devices: set[torch.device]
) -> None:
    """Make the current streams wait for the events recorded when the ranges were advertised
    (once per entry and event)."""
    for entry, desc in zip(entries, descs):
        if desc.event and desc.event not in entry.waited:
            for device in devices:
                wait_for_producer(device, desc.event)
            entry.waited.add(desc.event)


class _Batch(NamedTuple):
    """All the copies of a transfer as one operation of a device's current stream."""

    copy_batch: Callable[[int, torch.Tensor], None]  # the device's hook
    device_index: int  # the device's index
    table: torch.Tensor  # (destination, source, bytes) per pair, int64


def _batch(op: str, locals_: list, entries: list, descs: list, devices: set) -> _Batch | None:
    """The batch doing all the copies as one operation of the device's
    current stream, when its hooks have `copy_batch` and every pair is a contiguous range of one
    device's remote memory and a contiguous local tensor on that device or the CPU; else None
    (the per-pair path). Addresses come straight from the tensors: no views are made."""
    if len(descs) < _BATCH_MIN or len(devices) != 1:
        return None
    (device,) = devices
    copy_batch = hooks_for(device).copy_batch
    if copy_batch is None:
        return None
    bases: dict[int, int] = {}  # id(entry) -> its first byte's address
    remote = array.array("q")  # each pair's address in the peer's memory
    for local, entry, desc in zip(locals_, entries, descs):
        base = bases.get(id(entry))  # `entries` holds them: ids stay theirs
        if base is None:
            if entry.device != device:
                return None
            base = bases[id(entry)] = entry.data.data_ptr()
        if not local.is_contiguous():  # (a local tensor not on the CPU is on `device`)
            return None
        remote.append(base + desc.offset)
    mine = array.array("q", map(_address, locals_))
    sizes = array.array("q", [desc.nbytes for desc in descs])
    return _Batch(
        copy_batch,
        device.index,
        copy_table(mine, remote, sizes) if op == READ else copy_table(remote, mine, sizes),
    )


def _copy(pairs: Iterable[tuple]) -> None:
    """Each (destination, source, bytes): host addresses by memmove (one thread, no dispatch),
    tensors by `copy_`, the device's own copy path on the current stream."""
    with torch.no_grad():
        for dst, src, nbytes in pairs:
            if nbytes is None:
                dst.copy_(src)
            else:
                ctypes.memmove(dst, src, nbytes)


def _pair(op: str, local: torch.Tensor, entry: RemoteEntry, desc: Descriptor) -> tuple:
    """(destination, source, bytes) of one copy: addresses when both sides are contiguous host
    memory; else tensors (bytes None): byte views when the local tensor is contiguous, else the
    remote range viewed with the local tensor's dtype and shape (copy_ handles strides)."""
    if entry.host is not None and local.is_cpu and local.is_contiguous():
        here, there = local.data_ptr(), entry.host + desc.offset
        return (here, there, desc.nbytes) if op == READ else (there, here, desc.nbytes)
    assert entry.data is not None  # pinned: not unmapped while this transfer uses it
    remote = entry.data[desc.offset : desc.offset + desc.nbytes]
    if local.dtype is torch.uint8 and local.dim() == 1 and local.is_contiguous():
        local_view = local
    elif local.is_contiguous():
        local_view = local.view(-1).view(torch.uint8)
    else:
        if desc.offset % local.element_size():
            raise TransferSizeError(
                f"a non-contiguous local tensor of {local.dtype} needs a "
                f"remote range aligned to {local.element_size()} bytes, "
                f"this one starts at byte {desc.offset}"
            )
        remote = remote.view(local.dtype).view(local.shape)
        local_view = local
    return (local_view, remote, None) if op == READ else (remote, local_view, None)
