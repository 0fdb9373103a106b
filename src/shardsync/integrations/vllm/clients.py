"""The in-process ``vllm.LLM`` as a ``VLLMWeightSyncClient`` (vLLM ships HTTP and Ray clients; its offline
``LLM`` takes ``{"init_info": ...}`` / ``{"update_info": ...}`` wrappers instead of the bare dicts the client
protocol passes). ``as_client`` wraps an ``LLM`` and passes any other client through.

    engine = WeightTransferTrainerFactory.trainer_init(info, client=as_client(llm), source=source)
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLMClient", "as_client"]


class LLMClient:
    """vLLM's weight-sync client protocol over an in-process ``LLM`` (its offline RL mixin)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def workers(self) -> int | None:
        """The engine's worker processes (tensor x pipeline x data parallel ranks), if its config says."""
        cfg = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        par = getattr(cfg, "parallel_config", None)
        try:
            return int(par.world_size) * int(getattr(par, "data_parallel_size", 1) or 1)
        except (AttributeError, TypeError, ValueError):
            return None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        from .compat import finish_weight_update  # vLLM 0.26's LLM takes no version

        finish_weight_update(self.llm, weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        stop = getattr(self.llm, "shutdown_weight_transfer_engine", None)
        if stop is not None:  # vLLM 0.26 has none: its workers shut the engine down with themselves
            stop()


def as_client(client: Any) -> Any:
    """``LLMClient(client)`` for an in-process ``LLM`` (it has an ``llm_engine``), else ``client`` itself."""
    return LLMClient(client) if hasattr(client, "llm_engine") and not isinstance(client, LLMClient) else client
