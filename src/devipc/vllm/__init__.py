"""devipc for vLLM: a weight-transfer backend, `backend="devipc"`, that moves a trainer's weights
into vLLM engines through devipc's WeightPublisher / WeightSubscriber: zero-copy on one host
(any device with devipc hooks, and the CPU), over NIXL across hosts.

    from vllm.config import WeightTransferConfig
    llm = LLM(model, weight_transfer_config=WeightTransferConfig(backend="devipc"))   # engine

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory          # trainer
    devipc.pack_module(model)
    sync = WeightTransferTrainerFactory.trainer_init(DevipcTrainerInitInfo(rank=0),
                                                     client=client, source=ModuleSource(model))
    sync.send_weights()                         # after each optimizer step

An optional extra (`pip install 'devipc[vllm]'`); the core never imports it. Importing it
registers the backend; vLLM imports it in each of its processes through the
`vllm.general_plugins` entry point (`register`).
docs/vllm.md says what is checked before a generation touches the model, and what is not atomic.
Inside devipc it builds on `_core` and the weight publisher (`_weights`).
"""

from functools import partial

try:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
except ImportError as error:  # pragma: no cover - the extra is installed where this is tested
    raise ImportError(f"devipc.vllm needs vLLM: pip install 'devipc[vllm]' ({error})") from None

from .._public import name_as_public
from ._client import LLMClient
from ._engine import (
    BACKEND,
    DevipcInitInfo,
    DevipcUpdateInfo,
    DevipcWeightTransferEngine,
    RefusedUpdateError,
    manifest_of,
)
from ._in_use import weights_in_use
from ._trainer import DevipcTrainerInitInfo, DevipcTrainerWeightTransferEngine, ShardedSource

__all__ = [
    "BACKEND",
    "DevipcInitInfo",
    "DevipcTrainerInitInfo",
    "DevipcTrainerWeightTransferEngine",
    "DevipcUpdateInfo",
    "DevipcWeightTransferEngine",
    "LLMClient",
    "RefusedUpdateError",
    "ShardedSource",
    "manifest_of",
    "register",
    "weights_in_use",
]


def register() -> None:
    """Register the `devipc` backend with vLLM's engine and trainer factories (the entry point
    vLLM calls in each of its processes; a second call does nothing)."""
    for register_engine in (
        partial(WeightTransferEngineFactory.register_engine, BACKEND, DevipcWeightTransferEngine),
        partial(
            WeightTransferTrainerFactory.register_engine, BACKEND, DevipcTrainerWeightTransferEngine
        ),
    ):
        try:
            register_engine()
        except ValueError as error:
            if "already registered" not in str(error):
                raise


name_as_public(__name__, globals(), __all__)
register()  # in a trainer's process too: importing devipc.vllm is enough
