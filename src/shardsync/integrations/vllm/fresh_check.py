"""Compare a running worker with a FRESH load of a checkpoint, inside the worker, in about a second.

A fresh engine is the standard a sync is held to, but starting one takes tens of seconds on CPU. What a
fresh start does to the weights is vLLM's model loader: build the model from the engine's config, run
its ``load_weights`` on the checkpoint, run ``process_weights_after_loading``. :func:`fresh_check` runs
exactly that loader (``get_model_loader(load_config).load_model``) on the worker's own ``VllmConfig``
with the model path pointed at ``checkpoint``, then compares every tensor and probe output
(``model_state.inspect_model``) of the live model with the freshly loaded one, byte for byte. The fresh
model's attention layers register in a scratch forward context (vLLM refuses a second layer of the same
name), which is dropped with the model afterwards; the live engine is not touched.

    out = fresh_check(model, vllm_config, "/tmp/ckpt-v3")   # {"compared", "mismatched", "digest", ...}

Driven from the driver through ``init_weight_transfer_engine({"init_info": {"check_fresh": ckpt,
"inspect_to": out_dir}})``: each worker writes ``{out_dir}/fresh_rank{R}.json``.
"""

from __future__ import annotations

import gc
import hashlib
import time
from typing import Any

import torch
from torch import nn

from .model_state import compare, inspect_model

__all__ = ["fresh_check", "state_digest"]


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every key, dtype, shape and byte of an ``inspect_model`` result, in key order."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _fresh_model(vllm_config: Any, checkpoint: str) -> nn.Module:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    mc, cc, lc = vllm_config.model_config, vllm_config.compilation_config, vllm_config.load_config
    model_path, ctx, tqdm_on = mc.model, cc.static_forward_context, lc.use_tqdm_on_load
    mc.model, cc.static_forward_context, lc.use_tqdm_on_load = checkpoint, {}, False
    try:
        with set_current_vllm_config(vllm_config):
            return get_model_loader(lc).load_model(vllm_config=vllm_config, model_config=mc)
    finally:
        mc.model, cc.static_forward_context, lc.use_tqdm_on_load = model_path, ctx, tqdm_on


def fresh_check(model: nn.Module, vllm_config: Any, checkpoint: str, *, rank: int = 0) -> dict[str, Any]:
    """The live ``model`` vs a fresh load of ``checkpoint`` under ``vllm_config``: keys compared, the ones that
    differ (first 20), both digests, seconds. A fresh load that fails is reported (``error``, nothing compared),
    not raised."""
    t0 = time.perf_counter()
    live = inspect_model(model)
    try:  # an exception would take the engine down with it (vLLM treats a failed worker RPC as fatal)
        fresh = _fresh_model(vllm_config, checkpoint)
        try:
            ref = inspect_model(fresh)
        finally:
            del fresh
            gc.collect()
    except Exception as e:
        return {"rank": rank, "checkpoint": checkpoint, "compared": 0, "mismatched": [], "n_mismatched": 0,
                "error": f"fresh load of {checkpoint} failed: {type(e).__name__}: {e}"[:2000],
                "digest": state_digest(live), "fresh_digest": None, "seconds": round(time.perf_counter() - t0, 3)}
    n, bad = compare(live, ref)
    return {"rank": rank, "checkpoint": checkpoint, "compared": n, "mismatched": bad[:20], "n_mismatched": len(bad),
            "digest": state_digest(live), "fresh_digest": state_digest(ref),
            "seconds": round(time.perf_counter() - t0, 3)}
