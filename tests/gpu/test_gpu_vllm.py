"""GPU-only, ONE GPU is enough (``pytest -m gpu`` on the device machine, real vLLM from ``../shared/gpu-vllm``):
shardsync's vLLM worker and trainer backends, colocated on ``cuda:0``, against a FRESH GPU engine on the same
weights — every parameter and buffer after processing, greedy tokens, no parameter re-allocated by a sync (CUDA
graphs captured their addresses), and a sync aborted mid-way leaves an engine that refuses to serve until healed.

Every case runs ``benchmarks/gpu_vllm.py`` in its own process; all of them start at once (each engine has a fixed
KV cache, so they share the GPU) and each test waits for its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_vllm.py")
TIMEOUT_S = 1200

CASES = [  # (model, extra flags)
    ("tiny", ["--graphs", "--torn"]),         # Qwen3 dense, CUDA graphs on; then a torn sync, healed
    ("tiny-moe", []),                         # Qwen3-MoE, fused experts
    ("tiny-mla", []),                         # DeepSeek-V3-style MLA (W_UK_T / W_UV from kv_b_proj) + MoE
    ("tiny", ["--quant", "fp8"]),             # FP8 online quantisation of a bf16 checkpoint
    ("tiny", ["--checkpoint", "fp8-block"]),  # a block-FP8 checkpoint (128x128 weight_scale_inv)
    ("tiny", ["--checkpoint", "fp8-block", "--trainer", "bf16"]),  # a bf16 trainer into that engine (BlockFP8Source)
    ("tiny", ["--checkpoint", "fp8-channel"]),  # compressed-tensors FP8: per-channel weight_scale, dynamic acts
    ("tiny-moe", ["--delta", "0.01", "--delta-mode", "always", "--torn"]),  # delta sync (1 % changed a version) on
    # the GPU codec; a torn sync healed dense
    ("tiny-moe", ["--delta", "0.01"]),        # delta where it pays: the colocated worker maps the ring, reads dense
    ("tiny", ["--graphs", "--no-direct"]),     # the general path (layerwise buffers + first-load processing)
]
IDS = [f"{m}{''.join(f)}" for m, f in CASES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_vllm")
    procs = {}
    for ident, (model, flags) in zip(IDS, CASES):
        out, err = open(root / f"{ident}.out", "w"), open(root / f"{ident}.err", "w")
        procs[ident] = (subprocess.Popen([sys.executable, SCRIPT, "--model", model, "--syncs", "2", "--json",
                                          *flags], stdout=out, stderr=err), root / ident)
    deadline = time.monotonic() + TIMEOUT_S

    def result(ident: str) -> tuple[int, dict, str]:
        p, base = procs[ident]
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        err = open(f"{base}.err").read()
        lines = open(f"{base}.out").read().strip().splitlines()
        assert lines, f"{ident}: no JSON (exit code {rc})\n{err[-6000:]}"
        return rc, json.loads(lines[-1]), err

    yield result
    for p, _ in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("model,flags", CASES, ids=IDS)
def test_synced_gpu_engine_equals_a_fresh_gpu_engine(runs, model: str, flags: list[str]) -> None:
    rc, r, err = runs(f"{model}{''.join(flags)}")
    s = r["shardsync"]
    assert "error" not in s, err[-6000:]
    assert s["tensors_compared"] > 0 and s["mismatched"] == [] and s["tokens_match"], s
    if "--graphs" in flags:  # CUDA-graph safe: every parameter the graphs captured kept its address
        assert s["reallocated"] == [], s["reallocated"]
    if "--torn" in flags:  # aborted mid-way: refused to serve, named torn; a complete sync healed it (exact above)
        t = s["torn"]
        assert t["aborted_sync_error"] and "injected" in t["aborted_sync_error"], t
        assert t["worker_after_abort"]["torn"] and t["worker_after_abort"]["holds"].startswith("torn:"), t
        assert t["version_after_abort"] is None or t["version_after_abort"].startswith("torn:"), t  # 0.26: no labels
        assert t["served_after_abort"]["finish_reason"] == "error" and t["served_after_abort"]["tokens"] == [], t
        assert "TORN" in t["served_after_abort"]["stop_reason"], t
        assert not t["worker_after_heal"]["torn"] and t["worker_after_heal"]["holds"].isdigit(), t
        if "--delta" in flags:
            assert t["delta_heal"]["delta_dense_chunks"] > 0, t["delta_heal"]
    if "always" in flags:  # the last sync: every chunk a delta against the version held, few bytes read
        d, w = s["delta"], s["delta_worker"]
        assert d["delta_offered"] > 0 and w["delta_chunks"] > 0 and w["delta_heals"] == 0, (d, w)
        assert 0 < w["bytes_received"] * 4 < s["bytes"], (w, s["bytes"])
        # the directly written layers are the deltas' base: no held copy of them (most of the model on a GPU)
        assert w["delta_live_bytes"] > w["delta_held_bytes"] and w["delta_live_chunks"] > 0, w
    elif "--delta" in flags:  # colocated: nothing encoded, no bases held, no held copy on the worker
        d, w = s["delta"], s["delta_worker"]
        assert d["delta_offered"] == 0 and d["delta_skipped"] > 0 and d["delta_history_bytes"] == 0, d
        assert "delta_held_bytes" not in w, w
    if "--trainer" in flags:  # the trainer held bf16; the engine's checkpoint and the fresh engine's are block FP8
        assert r["trainer"] == "bf16" and s["tensors_compared"] > 0, r
    if "--no-direct" in flags:
        assert s["direct_modules"] == 0 and s["general_modules"] > 0, s
    elif "--quant" not in flags and "--checkpoint" not in flags:  # bf16 on a GPU: processing is the identity for
        assert s["direct_modules"] > 0, s                        # most modules, which are written directly
    assert s["exact"] and rc == 0
