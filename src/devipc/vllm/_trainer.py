"""The trainer's side: vLLM's `TrainerWeightTransferEngine` over one WeightPublisher, so that an RL
loop written for vLLM's `ipc` backend switches by its init info (`DevipcTrainerInitInfo`).

`trainer_init` publishes the source's tensors (with `copy=False`, the default, they must lie in
one allocation: `devipc.pack_module(model)` first) and gives the engine a token; `add_engine`
gives one to each further engine, also a late one. `send_weights` drives vLLM's lifecycle on
every engine: start, publish a generation (with its CRC-32), update (each engine waits for it,
checks it whole, loads it, acknowledges), finish.

A sharded trainer (`ShardedSource`: FSDP2's DTensors, or local shards and their layout) calls
both on every rank, as vLLM's trainer API does: each rank publishes its own shards
(`ShardedPublisher`, no gather), the ranks' tokens meet on rank 0 over torch.distributed, and
the engine assembles each tensor from the ranks that hold it (`ShardedSubscriber`).
"""

import base64
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    materialize_full_tensor,
)

from .._core._errors import AckTimeoutError, ConsumerDiedError
from .._weights._common import named_weights
from .._weights._publisher import WeightPublisher
from .._weights._shard_layout import Layout, layout_of
from .._weights._sharded import ShardedPublisher
from ._engine import BACKEND, DevipcInitInfo, DevipcUpdateInfo, manifest_of


@dataclass
class DevipcTrainerInitInfo(TrainerInitInfo):
    """`copy`, `transport`, `relay`: WeightPublisher's (`copy=True` publishes a staging copy, so
    the weights need not be packed; `transport="nixl"` for engines on other hosts). `checksum`:
    each generation's CRC-32, which engines verify before loading. `timeout`: seconds for each
    wait, on either side."""

    backend: ClassVar[str] = BACKEND
    copy: bool = False
    transport: str = "ipc"
    relay: bool = False
    checksum: bool = True
    timeout: float = 60.0


class ShardedSource(WeightSource):
    """One rank's weights of a sharded trainer, for backend 'devipc' on every rank: a module or
    state dict of DTensors (FSDP2's `fully_shard`, `distribute_tensor`), or of this rank's local
    shards with their `layout` (`devipc.ParamLayout` per name). devipc publishes each rank's
    shards where they lie; as a WeightSource of other backends it yields full tensors (a
    DTensor's `full_tensor()`, a collective), as vLLM's `ModuleSource` does."""

    def __init__(
        self, weights: torch.nn.Module | Mapping[str, torch.Tensor], layout: Layout | None = None
    ):
        self.weights = weights
        self.layout = dict(layout_of(dict(named_weights(weights))) if layout is None else layout)

    def metadata(self) -> list[ParamMeta]:
        named = dict(named_weights(self.weights))
        return [
            ParamMeta(name, named[name].dtype, self.layout[name].shape)
            for name in self.layout
            if name in named
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_weights(self.weights):
            if not hasattr(tensor, "full_tensor") and tensor.shape != self.layout[name].shape:
                raise TypeError(
                    f"{name!r} is a local shard: only DTensors gather into full tensors "
                    f"(backend 'devipc' publishes the shards as they are)"
                )
            yield name, materialize_full_tensor(tensor)


class DevipcTrainerWeightTransferEngine(TrainerWeightTransferEngine[DevipcTrainerInitInfo]):
    """A trainer publishing to any number of vLLM engines: one process (rank 0), or every rank
    of a sharded trainer (`ShardedSource`), each publishing its own shards."""

    init_info_cls = DevipcTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: DevipcTrainerInitInfo,
    ):
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.publisher: WeightPublisher | ShardedPublisher
        if isinstance(source, ShardedSource):
            if init_info.relay:
                raise ValueError(
                    "relay=True with a sharded trainer: each rank's shards go to every engine "
                    "from the rank itself (no relay chain per rank yet)"
                )
            self.publisher = ShardedPublisher(
                source.weights,
                source.layout,
                rank=init_info.rank,
                copy=init_info.copy,
                transport=init_info.transport,
            )
            self._manifest: dict[str, list] = {}  # the sender's, from every rank's (add_engine)
        else:
            weights = dict(source)
            self._manifest = manifest_of(weights)
            self.publisher = WeightPublisher(
                weights, copy=init_info.copy, transport=init_info.transport, relay=init_info.relay
            )
        self.clients: list[VLLMWeightSyncClient] = []

    @classmethod
    def trainer_init(
        cls,
        init_info: DevipcTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Publish `source`'s tensors and subscribe the engine behind `client` (on every rank
        of a sharded trainer: a collective)."""
        if source is None:
            raise ValueError(
                "backend 'devipc' publishes a WeightSource (vLLM's "
                "ModuleSource(model), or devipc.vllm.ShardedSource(model) on each rank of a "
                "sharded trainer): pass source="
            )
        if not init_info.is_sender and not isinstance(source, ShardedSource):
            raise ValueError(
                f"trainer rank {init_info.rank}: backend 'devipc' publishes a whole model from "
                f"rank 0, or each rank's shards of a devipc.vllm.ShardedSource(model)"
            )
        engine = cls(client=client, source=source, init_info=init_info)
        try:
            engine.add_engine(client)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def add_engine(self, client: VLLMWeightSyncClient) -> None:
        """Subscribe one more engine (a late one too): it takes part from the next
        `send_weights` on. A sharded trainer calls it on every rank (a collective)."""
        token, sharded = base64.b64encode(self.publisher.token()).decode(), None
        if isinstance(self.publisher, ShardedPublisher):
            token, sharded = "", self._meet(self.publisher, token)
        if self.is_sender:
            manifest = self._manifest
            info = DevipcInitInfo(
                token=token,
                names=manifest["names"],
                dtype_names=manifest["dtype_names"],
                shapes=manifest["shapes"],
                timeout=self.init_info.timeout,
                sharded=sharded,
            )
            client.init_weight_transfer_engine(asdict(info))
        if client not in self.clients:
            self.clients.append(client)

    def _meet(self, publisher: ShardedPublisher, token: str) -> dict[str, Any]:
        """Every rank's token and held dtypes meet on every rank (torch.distributed); the
        engine's `sharded` init info, and the manifest of the whole model."""
        held = {name: str(t.dtype).removeprefix("torch.") for name, t in publisher.shards.items()}
        ranks = {
            rank: (token, dtypes)
            for rank, token, dtypes in _all_ranks((publisher.rank, token, held), publisher.world)
        }
        dtypes = {name: dtype for rank in sorted(ranks) for name, dtype in ranks[rank][1].items()}
        names = list(publisher.layout)
        self._manifest = {
            "names": names,
            "dtype_names": [dtypes[name] for name in names],
            "shapes": [list(publisher.layout[name].shape) for name in names],
        }
        return {
            "tokens": [ranks[rank][0] for rank in sorted(ranks)],
            "layout": {name: param.to_json() for name, param in publisher.layout.items()},
        }

    def send_weights(self, weight_version: str | None = None) -> None:
        """Publish the weights as a new generation and load it into every engine; returns once
        each loaded it (`publisher.generation` is its number). An engine that refused it (or
        is gone) keeps its weights; the others still load it, then the first error is raised.
        `weight_version`: what vLLM's `get_weight_version()` says afterwards (None: unchanged).
        A sharded trainer calls it on every rank: each publishes its shards, rank 0 drives the
        engines, and every rank raises the first error (a collective)."""
        failures: list[Exception] = []
        clients = self.clients if self.is_sender else []
        started = _each(clients, lambda client: client.start_weight_update(), failures)
        publish = partial(
            self.publisher.publish,
            wait=False,
            timeout=self.init_info.timeout,
            checksum=self.init_info.checksum,
        )
        try:
            try:
                generation = publish()
            except ConsumerDiedError:  # an engine died since: named once, then not waited for
                generation = publish()
        except BaseException:
            _each(started, lambda client: client.finish_weight_update(), failures)  # loads nothing
            raise
        update = asdict(DevipcUpdateInfo(generation, checksum=self.init_info.checksum))
        loaded = _each(started, lambda client: client.update_weights(update), failures)
        _each(loaded, lambda client: client.finish_weight_update(weight_version), failures)
        try:
            self.publisher.wait_acks(generation, self.init_info.timeout)
        except (ConsumerDiedError, AckTimeoutError) as error:  # an engine's failure comes first
            failures.append(error)
        if isinstance(self.publisher, ShardedPublisher):
            said = _all_ranks(repr(failures[0]) if failures else None, self.publisher.world)
            elsewhere = [f"rank {rank}: {why}" for rank, why in enumerate(said) if why]
            if elsewhere and not failures:
                failures.append(RuntimeError(f"the update failed on {elsewhere[0]}"))
        if failures:
            raise failures[0]

    def shutdown(self) -> None:
        """Close the publisher: engines still subscribed are told (their next update raises)."""
        self.publisher.close()


def _all_ranks(value: Any, world: int) -> list[Any]:
    """`value` of every rank of a sharded trainer (torch.distributed's all-gather; one rank:
    its own)."""
    if world == 1:
        return [value]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world:
        raise RuntimeError(
            f"a sharded trainer of {world} ranks meets on torch.distributed: call "
            f"init_process_group with world_size={world} first (FSDP2 has)"
        )
    values: list[Any] = [None] * world
    dist.all_gather_object(values, value)
    return values


def _each(
    clients: list[VLLMWeightSyncClient],
    call: Callable[[VLLMWeightSyncClient], None],
    failures: list[Exception],
) -> list[VLLMWeightSyncClient]:
    """`call` on each client; the clients it succeeded on (the others' errors in `failures`:
    vLLM ended those engines' update sessions)."""
    done = []
    for client in clients:
        try:
            call(client)
        except Exception as error:  # noqa: BLE001 - collected: the caller raises them together
            failures.append(error)
            continue
        done.append(client)
    return done
