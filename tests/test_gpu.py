"""GPU-only: the two-GPU benchmark on a small model must be bit-exact (run on the device machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_benchmark_small_is_bit_exact(tmp_path) -> None:
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_sync.py")
    subprocess.run([sys.executable, script, "--layers", "2", "--experts", "16", "--iters", "1", "--out", str(tmp_path)],
                   check=True, timeout=900)
    summary = json.load(open(tmp_path / "gpu_sync.json"))
    assert summary["exact"] is True and summary["scenario_a"]["check_compared"] > 0
