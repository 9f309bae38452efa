"""Weight sync as one API: a trainer publishes generations of its weights, any number of engines
subscribe, each acknowledges what it used.

    pack_module(model)                         # once: weights and buffers in one allocation
    pub = WeightPublisher(model)               # copy=False: the packed memory is what engines see
    token = pub.token()                        # one per engine, by any transport
    pub.publish()                              # after each optimizer step: returns once all acked

    sub = WeightSubscriber(token)              # in the engine
    sub.wait(); sub.copy_into(engine_model); sub.ack()

It is an arena (`_arena`) underneath: one allocation shared once per subscriber, a control file
whose records hold each subscriber's acknowledged generation under an OFD lock (a dead subscriber
is found, named once, and no longer waited for), and two words that processes sleep on (a futex,
`_futex`): the newest published generation, which subscribers wait for, and a count of
acknowledgements, which the publisher waits for. A publish costs a few system calls whatever the
number of tensors, and nothing polls while it waits.

With `copy=False` the subscribers see the trainer's own memory: `publish(wait=True)` returns once
every subscriber acknowledged, so the trainer's next write comes after they are done; a
subscriber that joins meanwhile gets the next generation. With `copy=True` the weights are copied
(one batched device operation) into one of two staging buffers: the trainer never waits for the
engines' reading, only for the acknowledgement of the generation two publishes back, and a
subscriber that joins gets the newest generation at once.

With `transport="nixl"` the same classes work across hosts (`_publisher_remote`): a token then
carries a NIXL endpoint's metadata instead of an arena attachment, and each subscriber pulls
the generations into its own memory with one-sided reads.
"""
import threading
from collections.abc import Mapping

import torch

from . import _handles, _wire
from ._arena import Arena, ArenaReader, Attachment
from ._copies import copy_pairs, copy_rows
from ._errors import InvalidHandleError
from ._table import Table

__all__ = ["ACK_TIMEOUT", "InPlace", "WeightPublisher", "WeightSubscriber", "named_weights",
           "pack_module"]

ACK_TIMEOUT = 60.0  # a publisher's wait for the generation two back, with copy=True


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


def named_weights(weights: torch.nn.Module | Mapping[str, torch.Tensor],
                  ) -> list[tuple[str, torch.Tensor]]:
    if isinstance(weights, torch.nn.Module):
        return [(name, tensor.detach()) for name, tensor in weights.state_dict().items()]
    if isinstance(weights, Mapping):
        return [(name, tensor.detach()) for name, tensor in weights.items()]
    raise TypeError(f"publish a torch.nn.Module or a state dict, not {type(weights).__name__}")


class InPlace:
    """The weights a copy=False publisher sends where they lie, and the check, at each publish,
    that they still lie there: weights moved out of the allocation (FSDP's `resize_(0)` and
    `resize_(n)` of the packed storage, `model.to(...)` or `.double()`, a new `.data`) would
    otherwise go out as the old bytes under a new generation number."""

    def __init__(self, source: torch.nn.Module | Mapping[str, torch.Tensor],
                 items: list[tuple[str, torch.Tensor]], storage: torch.UntypedStorage):
        self._storage, self._where = storage, (storage.data_ptr(), storage.nbytes())
        # a module's own tensors, whose .data may move; a mapping is looked at again each time
        self._source = source
        self._tensors = (list(source.state_dict(keep_vars=True).values())
                         if isinstance(source, torch.nn.Module) else None)
        self._names = [name for name, _ in items]
        self._rows = [(t.data_ptr(), t.dtype, t.shape) for _, t in items]

    def check(self) -> None:
        """ValueError naming what left the published allocation."""
        advice = ("publish with copy=True, or pack the weights again (devipc.pack_module) and "
                  "make a new WeightPublisher")
        if (self._storage.data_ptr(), self._storage.nbytes()) != self._where:
            raise ValueError(f"the published allocation was resized or its memory replaced "
                             f"since the publisher was made (FSDP's resize_?): {advice}")
        tensors = self._tensors
        if tensors is None:
            source = self._source
            assert isinstance(source, Mapping)
            if len(source) != len(self._names) or list(source) != self._names:
                raise ValueError(f"the published state dict's names changed: {advice}")
            tensors = list(source.values())
        for name, tensor, (ptr, dtype, shape) in zip(self._names, tensors, self._rows):
            if tensor.dtype != dtype or tensor.shape != shape or (
                    tensor.data_ptr() != ptr and tensor.numel()):
                raise ValueError(f"{name!r} no longer lies where it was published (now "
                                 f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}, "
                                 f"moved by .to(), .double(), a new .data or a resize_): "
                                 f"{advice}")


class WeightPublisher:
    """The trainer's side: `token()` per subscriber, `publish()` per generation. With
    `transport="nixl"` subscribers may be on other hosts (`_publisher_remote`).

    Thread-safe: publishes from several threads take turns (each makes its own generation),
    and `close()` from another thread ends a `publish` or `wait_acks` under way there with
    ValueError."""

    def __new__(cls, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor], *,
                copy: bool = False, transport: str = "ipc") -> "WeightPublisher":
        if transport not in ("ipc", "nixl"):
            raise ValueError(f"transport is 'ipc' (one host) or 'nixl' (across hosts), not "
                             f"{transport!r}")
        if cls is WeightPublisher and transport == "nixl":
            from ._publisher_remote import NixlWeightPublisher

            return super().__new__(NixlWeightPublisher)
        return super().__new__(cls)

    def __init__(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor], *,
                 copy: bool = False, transport: str = "ipc"):
        self._source = model_or_state_dict
        items = _handles.named_items(named_weights(model_or_state_dict), "WeightPublisher")
        self.copy = bool(copy)
        self._in_place: InPlace | None = None
        if self.copy:
            self._table, end = Table.packed(items)
            self._arena = Arena(max(end, 1), items[0][1].device, buffers=2,
                                what="WeightPublisher")
        else:
            storage, self._table = _handles.in_place(items)
            self._in_place = InPlace(model_or_state_dict, items, storage)
            self._arena = Arena(storage.nbytes(), storage.device, buffers=1, storage=storage,
                                what="WeightPublisher")
        self.device = self._arena.device
        self.generation = -1

    def token(self) -> bytes:
        """One subscriber's way in (open it once, with `WeightSubscriber`); subscribers may join
        at any time."""
        attachment = self._arena.attach(from_newest=self.copy)
        writer = _wire.Writer(_wire.WEIGHTS).bytes(attachment)
        self._table.write(writer)
        return writer.done()

    def publish(self, *, wait: bool = True, timeout: float | None = None) -> int:
        """Make the current weights a new generation for every subscriber, once the device work
        that wrote them is done; returns it. With `wait`, returns once every live subscriber
        acknowledged it (`wait_acks`). With copy=False, ValueError if the weights left the
        packed allocation since the publisher was made (`InPlace`)."""
        if self._in_place is not None:
            self._in_place.check()
        fill = self._fill if self.copy else None
        generation = self._arena.publish(fill, ACK_TIMEOUT if timeout is None else timeout)
        self.generation = max(self.generation, generation)
        if wait:
            self.wait_acks(generation, timeout)
        return generation

    def _fill(self, storage: torch.UntypedStorage, base: int) -> None:
        items = named_weights(self._source)
        if [(name, t.dtype, tuple(t.shape)) for name, t in items] != list(
                zip(self._table.names, self._table.dtypes, self._table.shapes)):
            raise ValueError("the published tensors changed names, dtypes or shapes since the "
                             "publisher was made: make a new WeightPublisher")
        start = storage.data_ptr() + base
        rows = [(start + offset, tensor.data_ptr(), tensor.nbytes)
                for offset, (_, tensor) in zip(self._table.offsets, items)
                if tensor.numel() and tensor.is_contiguous()]
        if len(rows) == sum(1 for _, t in items if t.numel()) and copy_rows(self.device, rows):
            return
        views = self._table.views(storage, shift=base)
        copy_pairs([(views[name], tensor) for name, tensor in items])

    def wait_acks(self, generation: int, timeout: float | None = None) -> None:
        """Return once every live subscriber acknowledged `generation`. AckTimeoutError after
        `timeout` seconds (None: no bound, but dead subscribers still end the wait);
        ConsumerDiedError names subscribers found dead, once: they are no longer waited for.
        With copy=False the trainer may write its weights once this returns for the newest
        generation: a subscriber that opens its token from then on is not handed it (its
        memory is being overwritten) but the next one."""
        if not self.copy and generation == self._arena.generation:
            self._arena.announce(generation + 1)  # before the last look at who to wait for
        self._arena.wait_for(generation, timeout)

    def wait_subscribers(self, count: int, timeout: float = 60.0) -> None:
        """Return once `count` subscribers opened their tokens (engines starting up); with
        `copy=False` a subscriber that opens after a publish gets the next generation.
        TimeoutError after `timeout` seconds."""
        self._arena.wait_attached(count, timeout)

    def subscribers(self) -> dict[int, dict]:
        """Each subscriber record in use: state, acknowledged generation, pid."""
        return self._arena.consumers()

    def close(self) -> None:
        """Subscribers waiting are told (PeerGoneError); memory goes once they let go. The
        publisher no longer holds the model. Idempotent."""
        self._arena.close()
        self._source = {}

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<devipc.WeightPublisher {len(self._table)} tensors on {self.device}, "
                f"{'copy' if self.copy else 'in place'}, generation {self.generation}>")


def _remote_token(token: bytes | bytearray | memoryview) -> bool:
    """Whether a token's way in is a NIXL endpoint's metadata (else: an arena attachment, or bad
    bytes that the same-host path names)."""
    try:
        reader = _wire.Reader(token, (_wire.WEIGHTS,))
        way_in = reader.bytes("way in", 1 << 20)  # _publisher_remote's _WAY_IN_BYTES
        return _wire.Reader(way_in, (_wire.P2P_METADATA,)).kind == _wire.P2P_METADATA
    except InvalidHandleError:
        return False


class WeightSubscriber:
    """An engine's side: `wait()` for a generation, read `tensors()` or `copy_into(...)` its
    own weights, then `ack()`. Its calls from several threads take turns; `close()` from
    another thread ends a `wait` under way there with ValueError."""

    def __new__(cls, token: bytes | bytearray | memoryview,
                device: torch.device | str | int | None = None) -> "WeightSubscriber":
        if cls is WeightSubscriber and _remote_token(token):
            from ._publisher_remote import NixlWeightSubscriber

            return super().__new__(NixlWeightSubscriber)
        return super().__new__(cls)

    def __init__(self, token: bytes | bytearray | memoryview,
                 device: torch.device | str | int | None = None):
        # everything checked before the token's one open is spent
        reader = _wire.Reader(token, (_wire.WEIGHTS,))
        attachment = Attachment.from_bytes(reader.bytes("weights attachment", 1 << 16))
        self._table = Table.read(reader, attachment.nbytes)  # rows inside a buffer
        reader.end()
        self._reader = ArenaReader(attachment, device, what="WeightSubscriber")
        self._turns = threading.Lock()
        self.device = self._reader.device
        self.generation = -1
        self._views: dict[int, dict[str, torch.Tensor]] = {}

    def wait(self, timeout: float | None = None) -> int:
        """Block until a generation newer than the one held is published; returns the newest.
        PeerGoneError if the publisher closed or exited, TimeoutError after `timeout`."""
        with self._turns:
            self.generation = self._reader.wait(timeout)
            return self.generation

    def tensors(self) -> dict[str, torch.Tensor]:
        """The held generation's tensors by name: zero-copy views, valid until `ack()` (clone
        what must outlive it)."""
        if self.generation < 0:
            raise ValueError("no generation yet: wait() first")
        buffer = self.generation % self._reader.buffers
        views = self._views.get(buffer)
        if views is None:
            views = self._views[buffer] = self._reader.views(self.generation, self._table)
        return views

    def copy_into(self, module_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
                  ) -> None:
        """Copy the held generation into the engine's own tensors of the same names (one device
        operation where the hooks batch copies). Every name must match in dtype and shape."""
        source = self.tensors()
        targets = named_weights(module_or_state_dict)
        missing = sorted(set(source) - {name for name, _ in targets})
        if missing:
            raise KeyError(f"the engine has no tensors named {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}")
        pairs = []
        for name, target in targets:
            if name not in source:
                continue
            weights = source[name]
            if target.dtype != weights.dtype or target.shape != weights.shape:
                raise ValueError(f"{name!r}: the engine's tensor is {target.dtype} "
                                 f"{tuple(target.shape)}, the published one {weights.dtype} "
                                 f"{tuple(weights.shape)}")
            pairs.append((target, weights))
        copy_pairs(pairs)

    def ack(self) -> None:
        """Done with the held generation (its device work included): the publisher may go on."""
        if self.generation < 0:
            raise ValueError("no generation to acknowledge: wait() first")
        with self._turns:
            self._reader.ack(self.generation)

    def close(self) -> None:
        """Unsubscribe: the publisher no longer waits for this engine. Idempotent."""
        self._views.clear()
        self._reader.close()

    def __enter__(self) -> "WeightSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<devipc.WeightSubscriber {len(self._table)} tensors on {self.device}, "
                f"generation {self.generation}>")

