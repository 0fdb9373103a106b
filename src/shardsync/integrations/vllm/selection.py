"""Whether an engine selects the shardsync backend: the one test every hook of the plugin makes before it acts.

    if selects_shardsync(vllm_config): ...     # weight_transfer_config={"backend": "shardsync"}
"""

from __future__ import annotations

BACKEND = "shardsync"
"""The weight-transfer backend name vLLM's config selects."""


def selects_shardsync(vllm_config) -> bool:
    """Whether an engine's config selects the shardsync backend (the hooks act only in such engines)."""
    cfg = getattr(vllm_config, "weight_transfer_config", None)
    return getattr(cfg, "backend", None) == BACKEND
