"""vLLM's OpenAI server with shardsync: a request a torn engine refused is answered with the torn reason.

The engine core's guard (``guard``) finishes every request of a torn engine with ``finish_reason="error"`` and the
reason in ``stop_reason`` (which rank holds which versions, what failed). vLLM's OpenAI server turns any
``finish_reason == "error"`` into ``GenerationError("Internal server error")`` (``GenerateBaseServing.
_raise_if_error``, vllm/entrypoints/generate/base/serving.py), so a client saw HTTP 500 "Internal server error"
and the reason was nowhere. The plugin patches that method in the API server process (only there: it acts where
vLLM's server is loaded): an error whose output carries the guard's TORN reason raises vLLM's own
``RetryableRequestError`` with that reason instead (HTTP 503 ``ServiceUnavailableError``, also in a stream's error
event: the engine serves again once a sync completes). Every other error keeps vLLM's answer.

    r = requests.post(f"{url}/v1/completions", json={...})
    r.status_code == 503 and "TORN" in r.json()["error"]["message"]
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

__all__ = ["MAX_REASON_CHARS", "torn_reason", "install"]

MAX_REASON_CHARS = 2000
"""The longest torn reason put in a response (the guard's line names every torn rank)."""
_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
_MARK = "_shardsync_torn_reason"


def _outputs(value: Any) -> Iterator[Any]:
    if hasattr(value, "stop_reason"):
        yield value
    outs = getattr(value, "outputs", None)
    if isinstance(outs, list):
        yield from (o for o in outs if hasattr(o, "stop_reason"))


def torn_reason(scope: dict[str, Any]) -> str | None:
    """The guard's TORN reason in an errored output among ``scope``'s values (a serving method's locals: the
    ``output`` / ``res`` it was checking), or None."""
    for value in list(scope.values()):
        for out in _outputs(value):
            reason = getattr(out, "stop_reason", None)
            if getattr(out, "finish_reason", None) == "error" and isinstance(reason, str) and "TORN" in reason:
                return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."
    return None


def install() -> None:
    """Patch ``GenerateBaseServing._raise_if_error`` once, in a process running vLLM's API server; elsewhere (the
    engine core, workers, an offline ``LLM``) nothing is imported or changed."""
    if _SERVER_MODULE not in sys.modules:
        return
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing

    try:
        from vllm.exceptions import RetryableRequestError as Refused
    except ImportError:  # an older vLLM: its GenerationError (HTTP 500), with the reason
        from vllm.exceptions import GenerationError as Refused

    if getattr(GenerateBaseServing, _MARK, False):
        return
    original = GenerateBaseServing._raise_if_error

    def _raise_if_error(self, finish_reason, request_id):
        if finish_reason == "error":
            reason = torn_reason(sys._getframe(1).f_locals)  # the caller's output: the reason is only there
            if reason is not None:
                raise Refused(reason)
        return original(self, finish_reason, request_id)

    GenerateBaseServing._raise_if_error = _raise_if_error
    setattr(GenerateBaseServing, _MARK, True)
