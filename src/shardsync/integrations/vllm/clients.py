"""The in-process ``vllm.LLM`` as a ``VLLMWeightSyncClient`` (vLLM ships HTTP and Ray clients; its offline
``LLM`` takes ``{"init_info": ...}`` / ``{"update_info": ...}`` wrappers instead of the bare dicts the client
protocol passes), and vLLM's HTTP client with the server's error messages (``ShardsyncHTTPClient``). ``as_client``
wraps an ``LLM`` and a plain ``HTTPVLLMWeightSyncClient``, and passes any other client through.

    engine = WeightTransferTrainerFactory.trainer_init(info, client=as_client(llm), source=source)

vLLM's ``HTTPVLLMWeightSyncClient`` raises ``requests.HTTPError("500 Server Error ...")`` for every failure, while
vLLM's server puts the engine's message in the response body (``{"error": {"message": "Call to collective_rpc
method failed: rank 0: ...", "type", "code"}}``, vllm/entrypoints/serve/exception_handling). ``ShardsyncHTTPClient``
(the same constructor, ``(base_url, timeout=300)``) raises :class:`EngineHTTPError` carrying that message instead —
a ``requests.HTTPError`` still, and a shardsync ``SyncError`` — so the trainer's exception names the rank, the tensor
and what was expected, and an ownership refusal can be re-typed (``ownership.retype``).
"""

from __future__ import annotations

import sys
from typing import Any

import requests

from ...errors import SyncError

__all__ = ["LLMClient", "ShardsyncHTTPClient", "EngineHTTPError", "as_client", "count_workers"]

MAX_MESSAGE_CHARS = 4000
"""The most of a server's error body an :class:`EngineHTTPError` carries."""

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


class EngineHTTPError(SyncError, requests.HTTPError):
    """A weight-transfer route of vLLM's OpenAI server failed: the route, the HTTP status and the engine's message
    (from the response body; the server's log has the traceback)."""

    def __init__(self, message: str, *, route: str = "", status: int = 0, engine_message: str = "",
                 response: Any = None):
        super().__init__(message)
        self.response = response
        self.route, self.status, self.engine_message = route, status, engine_message


def error_message(response: Any) -> str:
    """The message of a vLLM server's error response: ``{"error": {"message": ...}}`` (vLLM's exception handlers),
    ``{"error": "..."}`` (its pause routes), ``{"detail": ...}`` (FastAPI), else the body's text; bounded."""
    try:
        body = response.json()
    except ValueError:
        body = None
    text = None
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        text = err.get("message") if isinstance(err, dict) else err
    if not isinstance(text, str) or not text:
        text = body if isinstance(body, (dict, list)) and body else (response.text or response.reason or "")
        text = text if isinstance(text, str) else str(text)
    text = text.strip()
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


try:
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient as _VllmHTTP
except ImportError:  # a vLLM without it: the in-process and Ray paths do not need it
    _VllmHTTP = object  # type: ignore[assignment,misc]


class ShardsyncHTTPClient(_VllmHTTP):  # type: ignore[misc,valid-type]
    """vLLM's ``HTTPVLLMWeightSyncClient`` (its routes and payloads unchanged) whose failures carry the server's
    message: :class:`EngineHTTPError`, e.g. ``POST /update_weights failed (HTTP 500): Call to collective_rpc method
    failed: rank 0: ...``.

        client = ShardsyncHTTPClient("http://127.0.0.1:8000")      # = HTTPVLLMWeightSyncClient(base_url, timeout)
    """

    def __init__(self, base_url: str, timeout: float = 300) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        response = requests.post(f"{self.base_url}/{path}", json=json, timeout=self.timeout)
        if response.status_code >= 400:
            msg = error_message(response)
            raise EngineHTTPError(f"vLLM server {self.base_url}: POST /{path} failed (HTTP {response.status_code}): "
                                  f"{msg}", route=path, status=response.status_code, engine_message=msg,
                                  response=response)


def as_client(client: Any) -> Any:
    """``LLMClient(client)`` for an in-process ``LLM`` (it has an ``llm_engine``); a :class:`ShardsyncHTTPClient` on
    the same server for vLLM's own ``HTTPVLLMWeightSyncClient`` (not a subclass of it: that may add its own
    headers); else ``client`` itself."""
    if type(client) is _VllmHTTP and _VllmHTTP is not object:
        return ShardsyncHTTPClient(client.base_url, timeout=client.timeout)
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
