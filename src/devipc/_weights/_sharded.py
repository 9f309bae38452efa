"""Weight sync from a sharded trainer: each of N trainer ranks publishes its own local shards
with a `WeightPublisher`, and an engine subscribes to all N, takes a generation only once every
rank published it, and reads only the slices it serves (`_shard_layout` says from which rank
each part comes).

Nothing new crosses between processes: each rank's publisher keeps its guarantees (a copy=False
rank writes again only once every engine acknowledged; dead engines named once), and the engine
acknowledges a generation to every rank only after it has it from all of them. So a rank's
`publish()` returns once every rank published that generation and every engine took it, and a
rank that dies mid-generation leaves every engine with the generation before, and an error that
names it.
"""

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from .._core._copies import copy_pairs
from .._core._errors import PeerGoneError
from ._common import Names, copy_into, named_weights, token_reader
from ._publisher import WeightPublisher, subscriber_backend
from ._publisher_local import LocalSubscriber
from ._shard_layout import Layout, ParamLayout, Slice, layout_of, plan, world_of

if TYPE_CHECKING:
    from ._remote_subscriber import NixlSubscriber

__all__ = ["ShardedPublisher", "ShardedSubscriber"]


class ShardedPublisher:
    """Trainer rank `rank`'s side: publishes its local shards of the weights laid out by
    `layout` (None: the DTensors' own, `layout_of`). `weights` holds the rank's local shards, or
    DTensors (their local tensors are published), as a state dict or a module. Every rank makes
    one, and every rank publishes every generation (`publish()`), in step: the generation an
    engine takes is the one all ranks published."""

    def __init__(
        self,
        weights: torch.nn.Module | Mapping[str, torch.Tensor],
        layout: Layout | None = None,
        *,
        rank: int,
        copy: bool = False,
        transport: str = "ipc",
    ):
        named = dict(named_weights(weights))
        self.layout: dict[str, ParamLayout] = dict(layout_of(named) if layout is None else layout)
        self.rank, self.world = rank, world_of(self.layout)
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} of a layout whose owners are ranks 0..{self.world - 1}")
        local = {}
        for name, param in self.layout.items():
            shape = param.local_shape(rank)
            if shape is None:
                continue
            if name not in named:
                raise KeyError(f"rank {rank} owns part of {name!r} but its weights lack it")
            tensor = named[name]
            if hasattr(tensor, "to_local"):
                tensor = tensor.to_local()
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name!r}: rank {rank}'s local shard is {tuple(tensor.shape)}, "
                    f"its layout says {shape} (of {param.shape})"
                )
            local[name] = tensor
        extra = sorted(set(named) - set(local))
        if extra:
            raise ValueError(
                f"rank {rank}'s weights name {extra[:5]}, which its layout gives it no part of"
            )
        if not local:
            raise ValueError(f"rank {rank} owns no part of any weight: it has nothing to publish")
        self.shards = local  # (this rank's local shards, by name)
        self._publisher = WeightPublisher(
            local, copy=copy, transport=transport, block_checksums=transport == "nixl"
        )

    generation = property(
        lambda self: self._publisher.generation,
        doc="The newest generation this rank published (-1: none yet).",
    )

    def token(self) -> bytes:
        """One engine's way in to this rank (open once); an engine takes one of every rank."""
        return self._publisher.token()

    def publish(
        self, *, wait: bool = True, timeout: float | None = None, checksum: bool = False
    ) -> int:
        """`WeightPublisher.publish` of this rank's shards. With `wait`, returns once every
        engine took the generation, which each does only once every rank published it."""
        return self._publisher.publish(wait=wait, timeout=timeout, checksum=checksum)

    def wait_acks(self, generation: int, timeout: float | None = None) -> None:
        self._publisher.wait_acks(generation, timeout)

    def wait_subscribers(self, count: int, timeout: float = 60.0) -> None:
        self._publisher.wait_subscribers(count, timeout)

    def subscribers(self) -> dict[int, dict]:
        return self._publisher.subscribers()

    def close(self) -> None:
        self._publisher.close()

    def __enter__(self) -> "ShardedPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardedSubscriber:
    """An engine's side: `tokens[r]` is trainer rank r's token, `layout` the trainer's;
    `slices` what the engine serves (per name: None for the whole tensor, or (dim, start,
    stop); `tp_slices` computes a tensor-parallel rank's; None: every tensor whole, as one
    publisher's engine). The plan (from which rank each part comes) is made here, once.
    `tensors()` of a slice held by one rank is a view of that rank's memory (zero-copy on one
    host); one that spans ranks is assembled from each, its bytes only, into a buffer of this
    engine made once. `options`: `WeightSubscriber`'s `share` and `prefetch`, across hosts."""

    def __init__(
        self,
        tokens: Sequence[bytes],
        layout: Layout,
        slices: Mapping[str, Slice] | None = None,
        device: torch.device | str | int | None = None,
        **options: bool,
    ):
        self.layout = dict(layout)
        world = world_of(self.layout)
        if len(tokens) != world:
            raise ValueError(
                f"{len(tokens)} tokens for a trainer of {world} ranks: one of each "
                f"rank, in rank order"
            )
        self._plan = plan(
            self.layout, {name: None for name in self.layout} if slices is None else slices
        )
        self._subs: list[LocalSubscriber | NixlSubscriber] = []
        try:
            for rank, token in enumerate(tokens):
                parts = {
                    name: piece.source
                    for name, (_, pieces) in self._plan.items()
                    for piece in pieces
                    if piece.rank == rank
                }
                self._subs.append(_subscriber(token, device, parts, options))
        except BaseException:
            self.close()
            raise
        self.device = self._subs[0].device
        self.generation = -1
        pulls = sum(hasattr(sub, "pull_bytes") for sub in self._subs)  # across hosts
        self._pool = ThreadPoolExecutor(len(self._subs), "devipc-sharded") if pulls > 1 else None
        self._checked = False
        self._buffers: dict[str, torch.Tensor] = {}
        self._held: dict[str, torch.Tensor] | None = None

    def wait(self, timeout: float | None = None) -> int:
        """Block until every rank published a generation newer than the one held; returns it.
        PeerGoneError naming the rank if one closed or died first (the engine keeps what it
        holds), TimeoutError naming the ranks that had not published it after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        target = self.generation + 1
        while True:
            self._reach(target, deadline, timeout)
            newest = max(sub.generation for sub in self._subs)
            if all(sub.generation == newest for sub in self._subs):
                break
            # joined mid-publish: a rank ahead; drop what the others hold and wait for it
            for sub in self._subs:
                if sub.generation < newest:
                    sub.ack()
            target = newest
        self.generation, self._held = newest, None
        return newest

    def _reach(self, target: int, deadline: float | None, timeout: float | None) -> None:
        """Every rank's subscriber holds `target` or a newer generation. On one host they are
        waited for one after another (nothing is pulled); across hosts at once, each in a thread
        of this subscriber's, so that the ranks' links carry their parts together."""
        behind = [rank for rank, sub in enumerate(self._subs) if sub.generation < target]
        if self._pool is None or len(behind) < 2:
            errors = []
            for rank in behind:
                errors.append(_caught(self._wait_rank, rank, target, deadline))
                if errors[-1] is not None:
                    break
        else:
            futures = [
                self._pool.submit(_caught, self._wait_rank, rank, target, deadline)
                for rank in behind
            ]
            errors = [future.result() for future in futures]
        gone = [
            (rank, error) for rank, error in zip(behind, errors) if isinstance(error, PeerGoneError)
        ]
        if gone:
            rank, why = gone[0]
            raise PeerGoneError(
                f"trainer rank {rank} of {len(self._subs)} is gone ({why}): "
                f"generation {target} is incomplete; this engine keeps "
                f"generation {self.generation}"
            ) from why
        if any(isinstance(error, TimeoutError) for error in errors):
            late = [rank for rank, sub in enumerate(self._subs) if sub.generation < target]
            raise TimeoutError(
                f"generation {target} not published by trainer ranks {late} "
                f"within {timeout} s (this engine keeps generation "
                f"{self.generation})"
            )
        for error in errors:
            if error is not None:
                raise error

    def _wait_rank(self, rank: int, target: int, deadline: float | None) -> None:
        sub = self._subs[rank]
        while sub.generation < target:
            sub.wait(None if deadline is None else max(deadline - time.monotonic(), 1e-9))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The slices served, by name, of the held generation: views of a rank's memory where
        one rank holds the slice, else this engine's assembled copy; valid until `ack()`."""
        if self.generation < 0:
            raise ValueError("no generation yet: wait() first")
        if self._held is None:
            locals_ = [sub.tensors() for sub in self._subs]
            if not self._checked:
                self._check(locals_)
            held, pairs = {}, []
            for name, (shape, pieces) in self._plan.items():
                if (
                    len(pieces) == 1
                    and tuple(locals_[pieces[0].rank][name][pieces[0].source].shape) == shape
                ):
                    held[name] = locals_[pieces[0].rank][name][pieces[0].source]
                    continue
                buffer = self._buffers.get(name)
                if buffer is None:
                    some = next(rank for rank in range(len(self._subs)) if name in locals_[rank])
                    buffer = self._buffers[name] = torch.empty(
                        shape, dtype=locals_[some][name].dtype, device=self.device
                    )
                pairs += [
                    (buffer[piece.target], locals_[piece.rank][name][piece.source])
                    for piece in pieces
                ]
                held[name] = buffer
            copy_pairs(pairs)
            for sub in self._subs:
                sub.check_held()  # (a relay's follower: its leader's buffer still holds it)
            self._held = held
        return self._held

    def _check(self, locals_: list[dict[str, torch.Tensor]]) -> None:
        """Once: each rank's published shards are those the layout gives it (tokens in rank
        order, the same layout on both sides)."""
        for rank, local in enumerate(locals_):
            expected = {
                name: param.local_shape(rank)
                for name, param in self.layout.items()
                if param.local_shape(rank) is not None
            }
            found = {name: tuple(tensor.shape) for name, tensor in local.items()}
            if found != expected:
                wrong = sorted(set(found.items()) ^ set(expected.items()))[:3]
                raise ValueError(
                    f"token {rank} publishes shards that are not trainer rank "
                    f"{rank}'s in this layout (differing: {wrong}): pass each "
                    f"rank's token at its rank, and the trainer's layout"
                )
        self._checked = True

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, slice) of the held generation, for an engine's own loader."""
        yield from self.tensors().items()

    def copy_into(
        self,
        module_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        names: Names = None,
    ) -> None:
        """`WeightSubscriber.copy_into` of the slices served: the engine's tensors are
        slice-shaped; floating dtypes convert; `names` maps a published name to the engine's."""
        copy_into(self.tensors(), module_or_state_dict, names)

    def verify(self) -> None:
        """ChecksumError unless every rank's bytes here are those it published with
        `publish(checksum=True)`: each rank's whole shard on one host (as
        `WeightSubscriber.verify`), each block pulled of it across hosts."""
        for sub in self._subs:
            sub.verify()

    def ack(self) -> None:
        """Done with the held generation: every rank may go on."""
        if self.generation < 0:
            raise ValueError("no generation to acknowledge: wait() first")
        self._held = None
        for sub in self._subs:
            sub.ack()

    def close(self) -> None:
        """Unsubscribe from every rank. Idempotent."""
        self._held = None
        for sub in self._subs:
            sub.close()
        pool = getattr(self, "_pool", None)  # (None too when the constructor failed first)
        if pool is not None:
            pool.shutdown()

    @property
    def pull_bytes(self) -> int:
        """The bytes of each generation this engine pulls across hosts, from all ranks (0 on one
        host: there it maps the ranks' memory)."""
        return sum(getattr(sub, "pull_bytes", 0) for sub in self._subs)

    def __enter__(self) -> "ShardedSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _subscriber(
    token: bytes,
    device: torch.device | str | int | None,
    parts: dict[str, tuple[slice, ...]],
    options: dict[str, bool],
) -> "LocalSubscriber | NixlSubscriber":
    """One rank's subscriber, as `WeightSubscriber` makes it; across hosts it pulls only
    `parts` of each generation (on one host nothing is pulled: the rank's memory is mapped)."""
    if options and token_reader(token)[0] != "nixl":
        raise ValueError(
            f"{sorted(options)}: options of subscribers across hosts "
            f"(transport='nixl'); on one host there is nothing to pull"
        )
    return subscriber_backend(token, device, parts=parts, **options)


def _caught(call: "Callable[..., None]", *args: object) -> BaseException | None:
    """What `call(*args)` raised, or None."""
    try:
        call(*args)
    except Exception as error:  # noqa: BLE001 - the caller raises it, named by rank
        return error
    return None
