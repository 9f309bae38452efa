"""What both weight publishers share (one host: `_publisher_local`; across hosts:
`_remote_publisher`): the weights as named tensors, packing a module, the copy=False check that
they still lie where they were published, the token's first field that says which kind it is,
the device an engine reads on (a token's checked against this host's), and copying a generation
into an engine's tensors."""

from collections.abc import Callable, Mapping
from operator import attrgetter

import torch

from .._core import _handles, _wire
from .._core._copies import copy_pairs
from .._core._devices import count_of, present
from .._core._errors import InvalidHandleError
from .._core._table import Table

__all__ = [
    "ACK_TIMEOUT",
    "ATTACH_TIMEOUT",
    "TRANSPORTS",
    "InPlace",
    "Names",
    "copy_into",
    "engine_device",
    "fill",
    "named_weights",
    "pack_module",
    "token_reader",
    "token_writer",
]

ACK_TIMEOUT = 60.0  # a publisher's wait for the generation two back, with copy=True
ATTACH_TIMEOUT = 60.0  # a publisher's wait_subscribers, unless told otherwise


def pack_module(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Move every parameter and persistent buffer of `module` into one new allocation laid out
    as a bucket, in place: each keeps its identity (an optimizer made before or after works
    unchanged) and now lies in that allocation, so training updates it there and
    `share_state_dict(module.state_dict(), copy=False)` or `WeightPublisher(module)` send it
    without a copy. Tied weights stay tied. Non-persistent buffers are not in a state dict and
    stay where they are. Returns the packed tensors by state-dict name."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"pack_module takes a torch.nn.Module, not {type(module).__name__}")
    named = module.state_dict(keep_vars=True)
    if not named:
        raise ValueError("this module has no parameters or persistent buffers to pack")
    packed = _handles.pack(named.items())
    with torch.no_grad():
        for name, tensor in named.items():
            tensor.data = packed[name]  # the same object, its memory moved
    return {name: tensor.data for name, tensor in named.items()}


def named_weights(
    weights: torch.nn.Module | Mapping[str, torch.Tensor],
    detach: bool = True,
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of a module's state dict or of a mapping; `detach=False` for a caller that
    only reads their bytes (a copy=True publish: a detach costs ~1 us a tensor)."""
    if isinstance(weights, torch.nn.Module):  # (state_dict detaches unless told to keep_vars)
        return list(weights.state_dict(keep_vars=not detach).items())
    if isinstance(weights, Mapping):
        return (
            [(name, tensor.detach()) for name, tensor in weights.items()]
            if detach
            else list(weights.items())
        )
    raise TypeError(f"publish a torch.nn.Module or a state dict, not {type(weights).__name__}")


_data_ptr, _numel, _dtype_of = torch.Tensor.data_ptr, torch.Tensor.numel, attrgetter("dtype")


class InPlace:
    """The weights a copy=False publisher sends where they lie, and the check, at each publish,
    that they still lie there: weights moved out of the allocation (FSDP's `resize_(0)` and
    `resize_(n)` of the packed storage, `model.to(...)` or `.double()`, a new `.data`) would
    otherwise go out as the old bytes under a new generation number."""

    def __init__(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor],
        items: list[tuple[str, torch.Tensor]],
        storage: torch.UntypedStorage,
    ):
        self._storage, self._where = storage, (storage.data_ptr(), storage.nbytes())
        # a module's own tensors, whose .data may move; a mapping is looked at again each time
        self._source = source
        self._tensors = (
            list(source.state_dict(keep_vars=True).values())
            if isinstance(source, torch.nn.Module)
            else None
        )
        self._names = [name for name, _ in items]
        tensors = [t for _, t in items]
        self._ptrs, self._dtypes = list(map(_data_ptr, tensors)), list(map(_dtype_of, tensors))
        self._numels, self._shapes = list(map(_numel, tensors)), [t.shape for t in tensors]

    def check(self) -> None:
        """ValueError naming what left the published allocation: a tensor that no longer starts
        where it was published, with its dtype and element count (a view reshaped in place, the
        same bytes, is not looked for)."""
        advice = (
            "publish with copy=True, or pack the weights again (devipc.pack_module) and "
            "make a new WeightPublisher"
        )
        if (self._storage.data_ptr(), self._storage.nbytes()) != self._where:
            raise ValueError(
                f"the published allocation was resized or its memory replaced "
                f"since the publisher was made (FSDP's resize_?): {advice}"
            )
        tensors = self._tensors
        if tensors is None:
            source = self._source
            assert isinstance(source, Mapping)
            if len(source) != len(self._names) or list(source) != self._names:
                raise ValueError(f"the published state dict's names changed: {advice}")
            tensors = list(source.values())
        if (
            list(map(_data_ptr, tensors)) == self._ptrs
            and list(map(_dtype_of, tensors)) == self._dtypes
            and list(map(_numel, tensors)) == self._numels
        ):
            return  # (C loops, 0.2 us a tensor: a shape is a new torch.Size each time it is read)
        for name, tensor, ptr, dtype, shape in zip(
            self._names, tensors, self._ptrs, self._dtypes, self._shapes
        ):
            if (
                tensor.dtype != dtype
                or tensor.shape != shape
                or (tensor.data_ptr() != ptr and tensor.numel())
            ):
                raise ValueError(
                    f"{name!r} no longer lies where it was published (now "
                    f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}, "
                    f"moved by .to(), .double(), a new .data or a resize_): "
                    f"{advice}"
                )


def fill(
    storage: torch.UntypedStorage, base: int, table: Table, items: list[tuple[str, torch.Tensor]]
) -> None:
    """A copy=True publisher's copy of the weights `items` into its buffer at byte `base` of
    `storage`, laid out by `table`: one batched device operation where the hooks offer it.
    ValueError if the tensors are no longer those the publisher was made with."""
    if [(name, t.dtype, tuple(t.shape)) for name, t in items] != list(
        zip(table.names, table.dtypes, table.shapes)
    ):
        raise ValueError(
            "the published tensors changed names, dtypes or shapes since the "
            "publisher was made: make a new WeightPublisher"
        )
    _handles.fill(storage, base, table, items)


TRANSPORTS = ("ipc", "nixl")  # a WeightPublisher token's first field: the index of its transport


def token_writer(transport: str) -> _wire.Writer:
    """A token of `transport` begins: its kind, then its transport."""
    return _wire.Writer(_wire.WEIGHTS).int(TRANSPORTS.index(transport))


def token_reader(
    token: bytes | bytearray | memoryview, transport: str | None = None
) -> tuple[str, _wire.Reader]:
    """The token's transport, and a reader at its next field; InvalidHandleError if it is no
    WeightPublisher token, or (`transport` given) one of another transport."""
    reader = _wire.Reader(token, (_wire.WEIGHTS,), "WeightPublisher token")
    found = TRANSPORTS[reader.int("token transport", 0, len(TRANSPORTS) - 1)]
    if transport is not None and found != transport:
        raise InvalidHandleError(
            f"a WeightPublisher token of transport {found!r}, not {transport!r}"
        )
    return found, reader


def engine_device(publisher: torch.device, device: torch.device | str | int | None) -> torch.device:
    """Where a subscriber pulls each generation: `device`, or the publisher's where None. The
    publisher's comes from the token, numbered by its host (or damaged bytes): one this process
    lacks is refused as InvalidHandleError, before anything is allocated, saying how to choose
    another; a `device` it lacks, as ValueError."""
    chosen = torch.device(publisher if device is None else device)
    if present(chosen):
        return torch.device("cpu") if chosen.type == "cpu" else chosen  # as torch names it
    count = count_of(chosen.type)
    here = f"this host has {count} {chosen.type} device(s)"
    if device is not None:
        raise ValueError(f"device={device!r}: {here}")
    example = f"{chosen.type}:0" if count else "cpu"
    raise InvalidHandleError(
        f"this weight token's publisher is on {publisher} and {here}: "
        f"choose where to read its weights with WeightSubscriber(token, "
        f"device=...), e.g. device={example!r}"
    )


# How `copy_into` names a published tensor in the engine: a dict of renames (names it leaves
# out keep theirs), or a callable; either gives None for a tensor the engine does not take.
Names = Mapping[str, "str | None"] | Callable[[str], "str | None"] | None


def _renamed(source: Mapping[str, torch.Tensor], names: Names) -> list[tuple[str, torch.Tensor]]:
    """(the engine's name, published tensor) for each published tensor `names` keeps."""
    if names is None:
        return list(source.items())
    if isinstance(names, Mapping):
        rename: Callable[[str], str | None] = lambda name: names.get(name, name)  # noqa: E731
    elif callable(names):
        rename = names
    else:
        raise TypeError(
            f"names is a dict or a callable from a published name to the "
            f"engine's (None: skip it), not {type(names).__name__}"
        )
    kept: list[tuple[str, torch.Tensor]] = []
    taken: dict[str, str] = {}  # the engine's name: the published name mapped onto it
    for name, tensor in source.items():
        engine = rename(name)
        if engine is not None:
            if not isinstance(engine, str):
                raise TypeError(
                    f"names gave {engine!r} for {name!r}: an engine's name is a "
                    f"str (or None to skip it)"
                )
            if engine in taken:  # one of the two would be overwritten by the other, unseen
                raise ValueError(
                    f"names maps both {taken[engine]!r} and {name!r} onto the "
                    f"engine's {engine!r}: map one of them to None to leave it "
                    f"out, or to a name of its own"
                )
            taken[engine] = name
            kept.append((engine, tensor))
    return kept


def copy_into(
    source: dict[str, torch.Tensor],
    module_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    names: Names = None,
) -> None:
    """Copy a held generation (`source`) into an engine's own tensors, by name (`names` maps
    them), as torch's `copy_` would: shapes must match; a floating dtype converts to another
    (an fp32 trainer, a bf16 engine), integer and bool dtypes must match. Byte copies of one
    device go as one batch where the hooks batch copies, and each pair of dtypes converts in
    one device operation (`torch.cat` into a scratch buffer of the engine's dtype)."""
    targets = dict(named_weights(module_or_state_dict))
    published = _renamed(source, names)
    missing = sorted({engine for engine, _ in published} - targets.keys())
    if missing:
        raise KeyError(
            f"the engine has no tensors named {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} (copy_into(..., names=...) maps "
            f"a published name to the engine's, or to None to leave it out)"
        )
    same: list[tuple[torch.Tensor, torch.Tensor]] = []
    converting: list[tuple[torch.Tensor, torch.Tensor]] = []
    for engine, weights in published:
        target = targets[engine]
        if target.shape != weights.shape or (
            target.dtype != weights.dtype
            and not (target.dtype.is_floating_point and weights.dtype.is_floating_point)
        ):
            raise ValueError(
                f"{engine!r}: the engine's tensor is {target.dtype} "
                f"{tuple(target.shape)}, the published one {weights.dtype} "
                f"{tuple(weights.shape)} (shapes must match; only floating "
                f"dtypes convert)"
            )
        (same if target.dtype == weights.dtype else converting).append((target, weights))
    copy_pairs(same + _converted(converting))


def _converted(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source in the target's dtype) for each pair: the sources of one device and one
    pair of dtypes gathered and converted by one `torch.cat` into a scratch buffer."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for target, source in pairs:
        groups.setdefault((source.device, source.dtype, target.dtype), []).append((target, source))
    out = []
    for (device, _, dtype), group in groups.items():
        scratch = torch.empty(
            sum(source.numel() for _, source in group), dtype=dtype, device=device
        )
        with torch.no_grad():
            torch.cat([source.reshape(-1) for _, source in group], out=scratch)
        parts = scratch.split([source.numel() for _, source in group])
        out += [(target, part.view(source.shape)) for (target, source), part in zip(group, parts)]
    return out
