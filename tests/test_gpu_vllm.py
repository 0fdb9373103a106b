"""GPU-only, ONE GPU is enough (``pytest -m gpu`` on the device machine, real vLLM from ``../shared/gpu-vllm``):
shardsync's vLLM worker and trainer backends, colocated on ``cuda:0``, against a FRESH GPU engine on the same
weights — every parameter and buffer after processing, greedy tokens, and no parameter re-allocated by a sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_vllm.py")

CASES = [  # (model, extra flags)
    ("tiny", ["--graphs"]),         # Qwen3 dense, CUDA graphs on
    ("tiny-moe", []),               # Qwen3-MoE, fused experts
    ("tiny-mla", []),               # DeepSeek-V3-style MLA (W_UK_T / W_UV from kv_b_proj) + MoE
    ("tiny", ["--quant", "fp8"]),   # FP8 online quantisation of a bf16 checkpoint
]


@pytest.mark.parametrize("model,flags", CASES, ids=[f"{m}{''.join(f)}" for m, f in CASES])
def test_synced_gpu_engine_equals_a_fresh_gpu_engine(model: str, flags: list[str]) -> None:
    p = subprocess.run([sys.executable, SCRIPT, "--model", model, "--syncs", "2", "--json", *flags],
                       capture_output=True, text=True, timeout=900)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    s = r["shardsync"]
    assert "error" not in s, p.stderr[-6000:]
    assert s["tensors_compared"] > 0 and s["mismatched"] == [] and s["tokens_match"], s
    if "--graphs" in flags:  # CUDA-graph safe: every parameter the graphs captured kept its address
        assert s["reallocated"] == [], s["reallocated"]
    assert s["exact"] and p.returncode == 0
