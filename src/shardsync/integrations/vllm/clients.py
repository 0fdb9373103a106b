"""The in-process ``vllm.LLM`` as a ``VLLMWeightSyncClient`` (vLLM ships HTTP and Ray clients; its offline
``LLM`` takes ``{"init_info": ...}`` / ``{"update_info": ...}`` wrappers instead of the bare dicts the client
protocol passes). ``as_client`` wraps an ``LLM`` and passes any other client through.

    engine = WeightTransferTrainerFactory.trainer_init(info, client=as_client(llm), source=source)
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["LLMClient", "as_client", "count_workers"]

COUNT_TIMEOUT_S = 10.0
"""Bound on asking an engine how many workers it runs (an HTTP GET, a Ray call)."""


class LLMClient:
    """vLLM's weight-sync client protocol over an in-process ``LLM`` (its offline RL mixin)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def workers(self) -> int | None:
        """The engine's worker processes (tensor x pipeline x data parallel ranks), if its config says."""
        ask = getattr(self.llm, "get_world_size", None)
        if callable(ask):
            try:
                return int(ask(include_dp=True))
            except Exception:  # an older LLM: its config below
                pass
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


def count_workers(client: Any, *, timeout_s: float = COUNT_TIMEOUT_S) -> int | None:
    """How many inference workers the engines behind ``client`` run (TP x PP x DP, summed over its engines), where
    the client can say: an in-process ``LLM`` (its config), vLLM's HTTP client (the server's ``/get_world_size``,
    the route beside ``/init_weight_transfer_engine``), vLLM's Ray client (each actor's ``LLM.get_world_size``), or
    any client with a ``workers()`` method. None where it cannot (the trainer then cannot check ``world_size``)."""
    own = getattr(client, "workers", None)
    if callable(own):
        return own()
    base = getattr(client, "base_url", None)
    if isinstance(base, str):
        import requests

        try:
            r = requests.get(f"{base.rstrip('/')}/get_world_size", params={"include_dp": "true"}, timeout=timeout_s)
            return int(r.json()["world_size"]) if r.ok else None
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return None
    handles = getattr(client, "handles", None)
    if isinstance(handles, list) and handles:
        ray = sys.modules.get("ray")  # Ray actor handles: ray is loaded already (this module never imports it)
        if ray is None:
            return None
        try:
            return sum(int(n) for n in ray.get([h.get_world_size.remote(True) for h in handles], timeout=timeout_s))
        except Exception:  # an actor without get_world_size, or one that does not answer in time
            return None
    return None
