"""vLLM's trainer API drives engines through a client (`VLLMWeightSyncClient`); vLLM ships one
for its HTTP server and one for Ray actors. This one drives an `LLM` object of this process,
whose engine core and worker may be processes of their own (vLLM's default)."""

from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload


class LLMClient:
    """`VLLMWeightSyncClient` for a `vllm.LLM` of this process."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
