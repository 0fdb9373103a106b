"""The chaos run's real-vLLM configuration: engines killed as whole process groups (between syncs and
mid-sync), a producer killed mid-sync and a replica left undriven for a version (a straggler), with every live
engine compared to a FRESH engine on the version it reports — or refusing to serve because it is torn."""

from __future__ import annotations

import pytest

from shardsync.tools.chaos import run_chaos_vllm


@pytest.mark.vllm
def test_chaos_with_real_vllm_engines(tmp_path) -> None:
    out = run_chaos_vllm(kills=4, seed=0, workdir=str(tmp_path))
    assert out["faults"] == 4 and out["syncs"] == 5, out
    assert out["deadlocks"] == 0 and out["torn_served"] == 0 and out["mismatched"] == 0, out
    assert out["compared"] > 0 and out["rejoined_exact"] >= 1, out  # the restarted engine is exact at its next sync
    assert out["straggler_versions"] == out["straggler_healthy_complete"] == 1, out  # the idle replica dropped
