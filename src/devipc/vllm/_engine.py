"""The engine's side: each vLLM worker subscribes to the trainer's WeightPublisher and loads every
generation through the model's own `load_weights`, once the generation passed its checks.

vLLM's lifecycle is start / update / finish. Here `update_weights` does it all: it waits for the
generation the trainer names, checks it whole (the generation asked for, every tensor of the
manifest present with its dtype and shape, its CRC-32 when published with one), and only then
runs vLLM's layerwise reload (set up, `load_weights`, finalize) and acknowledges. A generation
refused, or a trainer gone, raises RefusedUpdateError before anything touched the model, and
vLLM ends the session: the engine serves the weights it had. `start` and `finish` touch nothing.
"""

import base64
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import VllmConfig, WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from .._core._errors import ChecksumError, DevIpcError, PeerGoneError
from .._weights._publisher import WeightSubscriber
from .._weights._shard_layout import ParamLayout
from .._weights._sharded import ShardedSubscriber

BACKEND = "devipc"


class RefusedUpdateError(DevIpcError):
    """A weight update was refused before it touched the model (the trainer gone, a generation
    other than the one asked for, tensors missing or of other shapes, a checksum that differs):
    the engine keeps serving the weights it had. Send the weights again."""


@dataclass
class DevipcInitInfo(WeightTransferInitInfo):
    """What a worker needs (plain JSON, for vLLM's HTTP route too): its publisher token
    (base64) and the manifest every generation must match, by the trainer's names. From a
    sharded trainer, `sharded` instead of the token: {"tokens": one per trainer rank, in rank
    order, "layout": {name: ParamLayout.to_json()}}."""

    token: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    timeout: float = 60.0  # seconds a worker waits for the generation an update names
    sharded: dict[str, Any] | None = None


@dataclass
class DevipcUpdateInfo(WeightTransferUpdateInfo):
    """One update: the generation the trainer published for it, and whether it carries a
    checksum to verify."""

    generation: int
    checksum: bool = True


class DevipcWeightTransferEngine(WeightTransferEngine[DevipcInitInfo, DevipcUpdateInfo]):
    """vLLM's worker side of `backend="devipc"`. One worker per engine (tensor, pipeline and
    data parallel sizes of 1): each worker would need a token of its own."""

    init_info_cls = DevipcInitInfo
    update_info_cls = DevipcUpdateInfo
    supports_draft_weight_update = False  # one manifest: the target model's

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ):
        super().__init__(config, vllm_config, device, model)
        self._subscriber: WeightSubscriber | ShardedSubscriber | None = None
        self._manifest: list[tuple[str, str, list[int]]] = []
        self._timeout = 60.0
        self.loaded = -1  # the generation the model holds (-1: the one it started with)

    def init_transfer_engine(self, init_info: DevipcInitInfo) -> None:
        """Subscribe with the token (a new trainer's init replaces the previous one's)."""
        parallel = self.parallel_config
        workers = parallel.world_size * parallel.data_parallel_size
        if workers != 1:
            raise ValueError(
                f"backend 'devipc' serves engines of one worker; this one has "
                f"{workers} (tensor x pipeline x data parallel)"
            )
        if not (len(init_info.names) == len(init_info.dtype_names) == len(init_info.shapes)):
            raise ValueError("init_info's names, dtype_names and shapes differ in length")
        subscriber = _subscriber(init_info, self.device)
        self.shutdown()
        self._subscriber, self._timeout = subscriber, float(init_info.timeout)
        self._manifest = [
            (name, dtype, list(shape))
            for name, dtype, shape in zip(init_info.names, init_info.dtype_names, init_info.shapes)
        ]

    def start_weight_update(self) -> None:
        """Nothing to prepare: the model is touched only once a generation passed its checks."""
        self._held()

    def finish_weight_update(self) -> None:
        """Nothing left: the generation was loaded whole, and acknowledged, by `update_weights`."""

    def receive_weights(self, update_info: DevipcUpdateInfo) -> None:
        """Wait for the generation, check it whole, then load it through the model's own
        `load_weights` (vLLM's layerwise reload around it) and acknowledge it."""
        subscriber = self._held()
        self._check(subscriber, update_info)
        model: Any = self.model  # (vLLM's models add `load_weights` to torch.nn.Module)
        try:
            initialize_layerwise_reload(model)
            try:
                with disable_mtp_completeness_check():
                    model.load_weights(subscriber.weights())
                self.loaded = update_info.generation
            finally:  # also after a failure inside the loader: docs/vllm.md says what it leaves
                finalize_layerwise_reload(model, self.model_config)
        finally:
            subscriber.ack()

    def _check(
        self, subscriber: WeightSubscriber | ShardedSubscriber, update_info: DevipcUpdateInfo
    ) -> None:
        """RefusedUpdateError unless the generation asked for is held whole, as the manifest
        says; a refused generation is acknowledged (the trainer may go on) and not loaded."""
        held, wanted = self.loaded, update_info.generation
        try:
            generation = subscriber.wait(self._timeout)
            while generation < wanted:  # an older one, handed at once to a late subscriber
                subscriber.ack()
                generation = subscriber.wait(self._timeout)
        except (PeerGoneError, TimeoutError) as error:
            raise RefusedUpdateError(
                f"no generation {wanted} from the trainer ({error}); the "
                f"engine keeps generation {held}"
            ) from error
        try:
            if generation != wanted:
                raise ValueError(
                    f"the update asked for generation {wanted}, the trainer "
                    f"published {generation} since"
                )
            found = [
                (name, str(t.dtype).removeprefix("torch."), list(t.shape))
                for name, t in subscriber.tensors().items()
            ]
            if found != self._manifest:
                raise ValueError(_difference(self._manifest, found))
            if update_info.checksum:
                subscriber.verify()
        except (ChecksumError, ValueError) as error:
            subscriber.ack()
            raise RefusedUpdateError(
                f"generation {generation} refused before loading: {error}; "
                f"the engine keeps generation {held}"
            ) from error

    def _held(self) -> WeightSubscriber | ShardedSubscriber:
        if self._subscriber is None:
            raise RuntimeError(
                "backend 'devipc': call init_weight_transfer_engine with the "
                "trainer's init info first"
            )
        return self._subscriber

    def shutdown(self) -> None:
        """Unsubscribe: the trainer no longer waits for this engine."""
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None


def _subscriber(
    init_info: DevipcInitInfo, device: torch.device
) -> WeightSubscriber | ShardedSubscriber:
    """The trainer's subscriber: one publisher's, or every rank's of a sharded trainer (each
    tensor whole, assembled from the ranks that hold it)."""
    if init_info.sharded is None:
        return WeightSubscriber(base64.b64decode(init_info.token, validate=True), device=device)
    try:
        tokens = [base64.b64decode(token, validate=True) for token in init_info.sharded["tokens"]]
        layout = {
            name: ParamLayout(*fields) for name, fields in init_info.sharded["layout"].items()
        }
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"init_info's sharded is {{'tokens': [...], 'layout': {{...}}}} as "
            f"DevipcTrainerWeightTransferEngine makes it ({error})"
        ) from error
    return ShardedSubscriber(tokens, layout, device=device)


def _difference(
    expected: list[tuple[str, str, list[int]]], found: list[tuple[str, str, list[int]]]
) -> str:
    """What a generation lacks, or holds of another dtype or shape, against the manifest."""
    want, got = {n: rest for n, *rest in expected}, {n: rest for n, *rest in found}
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    if missing or extra:
        return f"tensors missing {missing[:5]}, not in the manifest {extra[:5]}"
    differ = [
        f"{n}: {got[n][0]} {got[n][1]}, expected {want[n][0]} {want[n][1]}"
        for n in want
        if got[n] != want[n]
    ]
    return "; ".join(differ[:5]) or "the tensors come in another order than the manifest's"


def manifest_of(weights: dict[str, torch.Tensor]) -> dict[str, list]:
    """The manifest of `weights` as DevipcInitInfo carries it."""
    return {
        "names": list(weights),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
    }
