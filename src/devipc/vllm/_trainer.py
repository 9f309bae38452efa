"""The trainer's side: vLLM's `TrainerWeightTransferEngine` over one WeightPublisher, so that an RL
loop written for vLLM's `ipc` backend switches by its init info (`DevipcTrainerInitInfo`).

`trainer_init` publishes the source's tensors (with `copy=False`, the default, they must lie in
one allocation: `devipc.pack_module(model)` first) and gives the engine a token; `add_engine`
gives one to each further engine, also a late one. `send_weights` drives vLLM's lifecycle on
every engine: start, publish a generation (with its CRC-32), update (each engine waits for it,
checks it whole, loads it, acknowledges), finish.
"""

import base64
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from .._core._errors import AckTimeoutError, ConsumerDiedError
from .._weights._publisher import WeightPublisher
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


class DevipcTrainerWeightTransferEngine(TrainerWeightTransferEngine[DevipcTrainerInitInfo]):
    """One trainer process (rank 0) publishing to any number of vLLM engines."""

    init_info_cls = DevipcTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: DevipcTrainerInitInfo,
    ):
        super().__init__(client=client, source=source, is_sender=True)
        self.init_info = init_info
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
        """Publish `source`'s tensors and subscribe the engine behind `client`."""
        if source is None:
            raise ValueError(
                "backend 'devipc' publishes a WeightSource (vLLM's "
                "ModuleSource(model)): pass source="
            )
        if not init_info.is_sender:
            raise ValueError(
                "backend 'devipc' publishes from one trainer process (rank 0); "
                "gather a sharded model there first"
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
        `send_weights` on."""
        info = DevipcInitInfo(
            token=base64.b64encode(self.publisher.token()).decode(),
            timeout=self.init_info.timeout,
            **self._manifest,
        )
        client.init_weight_transfer_engine(asdict(info))
        if client not in self.clients:
            self.clients.append(client)

    def send_weights(self, weight_version: str | None = None) -> None:
        """Publish the weights as a new generation and load it into every engine; returns once
        each loaded it (`publisher.generation` is its number). An engine that refused it (or
        is gone) keeps its weights; the others still load it, then the first error is raised.
        `weight_version`: what vLLM's `get_weight_version()` says afterwards (None: unchanged)."""
        failures: list[Exception] = []
        started = _each(self.clients, lambda client: client.start_weight_update(), failures)
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
        if failures:
            raise failures[0]

    def shutdown(self) -> None:
        """Close the publisher: engines still subscribed are told (their next update raises)."""
        self.publisher.close()


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
