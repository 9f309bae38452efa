"""Typed handles: a tensor (`share`) or a bucket of named tensors packed into one allocation
(`share_tensors`) as devipc wire bytes, opened in any process with no pickle involved.

A handle is one send: one ref-counter slot, opened once (`open` / `open_tensors`), or taken back
unopened (`Handle.revoke`). A bucket is one device allocation, one memory handle and one slot for
any number of tensors: a trainer can publish its weights in one message and the consumer maps
them once, as zero-copy views.
"""

import array
import operator
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat

import torch

from . import _sharing, _wire
from ._copies import copy_batched, copy_pairs
from ._errors import InvalidHandleError
from ._hooks import hooks_for
from ._host import HostSend, shared_host_storage
from ._refcount import SLOTS_PER_FILE
from ._table import MAX_NAME, Table

__all__ = ["Handle", "open", "open_tensors", "pack", "share", "share_tensors"]

_device_of = operator.attrgetter("device")
_nbytes_of = operator.attrgetter("nbytes")
_kind_of = operator.attrgetter("device", "layout", "dtype", "is_nested")


class Handle:
    """One send of a tensor or a bucket. `bytes(handle)` is all a consumer needs; pickling a
    handle sends the same bytes. `local` is the producer's own views of a bucket it packed (None
    elsewhere): writes through it reach the consumers, and theirs come back."""

    __slots__ = ("_bucket", "_shared", "_identity", "_requires_grad", "_table", "_local", "_packed")

    def __init__(
        self,
        *,
        bucket: bool,
        shared: _sharing.SharedStorage,
        identity: bytes,
        table: Table,
        requires_grad: bool = False,
        local: dict[str, torch.Tensor] | None = None,
        packed: torch.UntypedStorage | None = None,
    ):
        """`local`: the producer's tensors; or `packed`, the storage they were packed into,
        whose views `local` makes when first asked (a snapshot sent is rarely looked at)."""
        self._bucket, self._shared, self._identity = bucket, shared, identity
        self._requires_grad, self._table = requires_grad, table
        self._local, self._packed = local, packed

    @property
    def local(self) -> dict[str, torch.Tensor] | None:
        if self._local is None and self._packed is not None:
            self._local, self._packed = self._table.views(self._packed), None
        return self._local

    @property
    def kind(self) -> str:
        return "bucket" if self._bucket else "tensor"

    @property
    def device(self) -> torch.device:
        """The producer's device, in the producer's numbering."""
        return self._shared.device

    @property
    def names(self) -> tuple[str, ...]:
        """A bucket's names, in order; a tensor handle has one, ""."""
        return tuple(self._table.names)

    @property
    def nbytes(self) -> int:
        return self._shared.size_bytes

    def __bytes__(self) -> bytes:
        shared = self._shared
        writer = _wire.Writer(_wire.BUCKET if self._bucket else _wire.TENSOR)
        writer.device(shared.device).bytes(self._identity).bytes(shared.handle or b"")
        writer.int(shared.size_bytes).int(shared.offset_bytes)
        writer.bytes(shared.ref_counter_handle or b"").int(shared.ref_counter_offset)
        writer.bytes(shared.event_handle).int(int(shared.event_sync_required))
        writer.int(int(self._requires_grad))
        self._table.write(writer)
        return writer.done()

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, name: str = "devipc handle"
    ) -> "Handle":
        """Any handle's bytes, validated; anything else raises InvalidHandleError. `name`: what
        errors call it (what the user holds: a WeightPublisher token)."""
        return _wire.decode(lambda data: cls._decode(data, name), data, name)

    @classmethod
    def _decode(cls, data: bytes | bytearray | memoryview, name: str = "devipc handle") -> "Handle":
        reader = _wire.Reader(data, (_wire.TENSOR, _wire.BUCKET), name)
        device = reader.device()
        identity = reader.bytes("device identity", 256)
        mem = reader.bytes("memory handle")
        size = reader.int("storage size")
        offset = reader.int("storage offset in its allocation")
        counter = reader.bytes("ref-counter handle", 1024)
        slot = reader.int("ref-counter slot", 0, SLOTS_PER_FILE - 1)
        event = reader.bytes("event handle")
        sync = reader.flag("event flag")
        requires_grad = reader.flag("requires_grad")
        if bool(mem) != bool(counter) or (not mem and size):
            raise InvalidHandleError(
                "a handle of a non-empty storage needs both a memory handle "
                "and a ref-counter handle"
            )
        table = _read_table(reader, size)
        if reader.kind == _wire.TENSOR and len(table) != 1:
            raise InvalidHandleError(f"a tensor handle holds one tensor, this one {len(table)}")
        if requires_grad:
            if reader.kind == _wire.BUCKET:
                raise InvalidHandleError("a bucket handle's tensors never require grad")
            _sharing.check_grad(table.dtypes[0], requires_grad)
        reader.end()
        shared = _sharing.SharedStorage(
            device, mem or None, size, offset, counter or None, slot, event, sync
        )
        return cls(
            bucket=reader.kind == _wire.BUCKET,
            shared=shared,
            identity=identity,
            table=table,
            requires_grad=requires_grad,
        )

    def __reduce__(self) -> tuple[Callable[[bytes], "Handle"], tuple[bytes]]:
        return Handle.from_bytes, (bytes(self),)

    def revoke(self) -> bool:
        """Producer: take this send back if no consumer opened it (opening it later raises
        InvalidHandleError); whether it did. Only the process that made the handle can."""
        counter, slot = self._shared.ref_counter_handle, self._shared.ref_counter_offset
        return counter is not None and _sharing.revoke_send(counter, slot)

    def unopened(self) -> bool:
        """Producer: whether this send may still be opened (not opened, revoked nor expired)."""
        counter, slot = self._shared.ref_counter_handle, self._shared.ref_counter_offset
        return counter is not None and _sharing.send_unopened(counter, slot)

    def __repr__(self) -> str:
        return (
            f"<devipc.Handle {self.kind} of {len(self._table)} on {self.device}, "
            f"{self.nbytes} bytes>"
        )


_TABLES_KEPT = 16
_tables: dict[tuple[bytes, int], Table] = {}


def _read_table(reader: _wire.Reader, storage_bytes: int) -> Table:
    """The table that ends a handle, checked against its storage's size. Kept by its bytes: a
    trainer sends the same table step after step, and its thousands of rows cost milliseconds
    to check (a kept one is shared: tables are never changed once made)."""
    key = (reader.rest(), storage_bytes)
    table = _tables.get(key)
    if table is not None:
        reader.skip_rest()
        return table
    table = Table.read(reader, storage_bytes)
    reader.end()
    if len(_tables) >= _TABLES_KEPT:
        _tables.clear()
    _tables[key] = table
    return table


def identity_of(device: torch.device) -> bytes:
    """The device's identity for a handle (the hooks' optional `device_identity`), or b""."""
    try:
        return bytes(hooks_for(device).device_identity(device))[:256]
    except Exception:  # noqa: BLE001 - optional: a handle without identity still opens
        return b""


def _check(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} is not a tensor but {type(tensor).__name__}")
    hooks_for(tensor.device)  # UnsupportedDeviceError for devices that cannot share
    _check_kind(tensor, what)
    return tensor


def _check_kind(tensor: torch.Tensor, what: str) -> None:
    if tensor.layout != torch.strided or tensor.is_nested:
        raise _sharing.unsendable(tensor, what)
    _wire.dtype_code(tensor.dtype)


def share(tensor: torch.Tensor) -> Handle:
    """One send of `tensor`, zero-copy: the consumer maps the same memory."""
    _check(tensor, "share()")
    shared = _sharing.share_device(tensor.untyped_storage())
    return Handle(
        bucket=False,
        shared=shared,
        identity=identity_of(shared.device),
        table=Table.where_they_lie([("", tensor)]),
        requires_grad=tensor.requires_grad,
    )


def share_tensors(
    named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], copy: bool = True
) -> Handle:
    """One send of many tensors, one memory handle and one slot. With `copy` (a snapshot), they
    are copied into one new allocation on their device, each at an offset aligned to 256 bytes.
    With `copy=False`, they must all be views of one storage (`devipc.pack` makes such weights),
    which is shared as it is: no copy, and the consumer sees later writes, as with `share`."""
    return pack_and_share(named_tensors, aliases=False, copy=copy)


def pack(
    named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The tensors copied into one new allocation on their device, laid out as a bucket: weights
    kept there (`param.data = packed[name]`) are sent with `share_tensors(packed, copy=False)`,
    one handle and no copy per sync. Names of one same view stay tied. CPU tensors are packed
    into torch's shared memory, for a CPU trainer's `WeightPublisher`."""
    items = named_items(named_tensors, "pack()", host=True)
    table, end = Table.packed(items, aliases=True)
    device = items[0][1].device
    storage = (
        shared_host_storage(end)
        if device.type == "cpu"
        else torch.empty(max(end, 1), dtype=torch.uint8, device=device).untyped_storage()
    )
    fill(storage, 0, table, items)
    return table.views(storage)


def pack_and_share(
    named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    aliases: bool,
    copy: bool = True,
) -> Handle:
    """`share_tensors`; with `aliases`, names of one same view share its bytes (tied weights)."""
    items = named_items(named_tensors, "share_tensors()")
    device = items[0][1].device
    if copy:
        table, end = Table.packed(items, aliases)
        storage = torch.empty(max(end, 1), dtype=torch.uint8, device=device).untyped_storage()
        fill(storage, 0, table, items)
        local, packed = None, storage
    else:
        storage, table = in_place(items)
        local, packed = dict(items), None
    shared = _sharing.share_device(storage)
    _sharing.counts["buckets_shared"] += 1
    _sharing.counts["bucket_tensors_shared"] += len(table)
    return Handle(
        bucket=True,
        shared=shared,
        identity=identity_of(device),
        table=table,
        local=local,
        packed=packed,
    )


def in_place(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.UntypedStorage, Table]:
    """The one storage `items` are views of, and their table where they already lie."""
    storages = {tensor.untyped_storage().data_ptr() for _, tensor in items}
    if len(storages) != 1:
        raise ValueError(
            f"sending without a copy needs views of one storage, got tensors of "
            f"{len(storages)} storages: keep a model's weights in one allocation "
            f"with devipc.pack_module(model) (or devipc.pack for a dict), or pass "
            f"copy=True to send a copy"
        )
    return items[0][1].untyped_storage(), Table.where_they_lie(items)


def named_items(
    named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    what: str,
    host: bool = False,
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a dict or an iterable of pairs: unique names, one device that
    can share (or, with `host`, the CPU: a weight publisher's host memory). One pass over the
    tensors collects their kinds; a bad kind is looked up again to be named."""
    items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    names, tensors = [name for name, _ in items], [tensor for _, tensor in items]
    if (
        set(map(type, names)) - {str}
        or max(map(len, names), default=0) > MAX_NAME // 4
        or not all(issubclass(kind, torch.Tensor) for kind in set(map(type, tensors)))
    ):
        # (C loops above; this one names the culprit)
        for name, tensor in items:
            if (
                not isinstance(name, str)
                or len(name) > MAX_NAME // 4
                and len(name.encode()) > MAX_NAME
            ):
                raise ValueError(
                    f"a bucket's names are strings of at most {MAX_NAME} bytes, got {name!r:.80}"
                )
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{what}[{name!r}] is not a tensor but {type(tensor).__name__}")
    kinds = set(map(_kind_of, tensors))
    if len(set(names)) != len(items):
        raise ValueError("a bucket's names must be unique")
    devices = {device for device, *_ in kinds}
    for device in devices:
        if not (host and device.type == "cpu"):
            hooks_for(device)  # UnsupportedDeviceError for devices that cannot share
    if len(devices) > 1:
        raise ValueError(
            f"a bucket's tensors must all be on one device, got {sorted(map(str, devices))}"
        )
    if not devices:
        raise ValueError("a bucket needs at least one tensor")
    for _, layout, dtype, nested in kinds:
        if layout != torch.strided or nested or dtype not in _wire.DTYPE_CODES:
            for name, tensor in items:
                _check_kind(tensor, f"{what}[{name!r}]")
    return items


def fill(
    storage: torch.UntypedStorage,
    base: int,
    table: Table,
    items: Sequence[tuple[str, torch.Tensor]],
) -> None:
    """Copy `items` into `storage` at `base` + their table's offsets (`table` lays out these
    very tensors): one batched device operation of (destination, source, bytes) rows where every
    tensor is contiguous and the hooks offer `copy_batch`, else `copy_` through views."""
    start = storage.data_ptr() + base
    tensors = [tensor for _, tensor in items]
    if all(map(torch.Tensor.is_contiguous, tensors)) and set(map(_device_of, tensors)) == {
        storage.device
    }:
        # columns made by C loops: destinations, sources, sizes; empty tensors left out
        sizes = list(map(_nbytes_of, tensors))
        kept = list(map(bool, sizes))
        if copy_batched(
            storage.device,
            array.array("q", compress(map(operator.add, table.offsets, repeat(start)), kept)),
            array.array("q", compress(map(torch.Tensor.data_ptr, tensors), kept)),
            array.array("q", compress(sizes, kept)),
        ):
            return
    views = table.views(storage, shift=base)
    copy_pairs(list(zip(views.values(), tensors)))


def bucket_or_host_send(data: bytes, name: str) -> "Handle | HostSend":
    """The bytes of a whole storage sent either way: a bucket handle of device memory, or a
    HostSend of CPU memory (an arena's, a Ray object's). InvalidHandleError for anything else."""
    if _wire.Reader(data, (_wire.BUCKET, _wire.HOST), name).kind == _wire.HOST:
        return HostSend.from_bytes(data, name)
    return Handle.from_bytes(data, name)


def _as_handle(handle: Handle | bytes | bytearray | memoryview) -> Handle:
    return handle if isinstance(handle, Handle) else Handle.from_bytes(handle)


def open_storage(handle: Handle, device: torch.device | str | int | None) -> torch.UntypedStorage:
    """The storage a handle sends (its one slot taken), on `device` if given."""
    target = None if device is None else _sharing.local_device(device, handle.device.type)
    shared = handle._shared
    if shared.handle is None:
        return _sharing.empty_storage(target or shared.device)
    return _sharing.new_shared_device(*shared, target=target)


def open(
    handle: Handle | bytes | bytearray | memoryview, device: torch.device | str | int | None = None
) -> torch.Tensor:
    """The tensor of a `share` handle (or its bytes), zero-copy. On the local device that owns
    the memory (found by identity), or on `device` when its hooks can map the memory there
    (else UnsupportedDeviceError)."""
    handle = _as_handle(handle)
    if handle.kind != "tensor":
        raise InvalidHandleError("this is a bucket handle: open it with devipc.open_tensors")
    views = handle._table.views(open_storage(handle, device), requires_grad=handle._requires_grad)
    return views[""]


def open_tensors(
    handle: Handle | bytes | bytearray | memoryview, device: torch.device | str | int | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a `share_tensors` handle (or its bytes), by name: zero-copy views of one
    mapping. `device` as in `open`."""
    handle = _as_handle(handle)
    if handle.kind != "bucket":
        raise InvalidHandleError("this is a tensor handle: open it with devipc.open")
    return handle._table.views(open_storage(handle, device))
