"""The chaos run's real-vLLM configuration: an engine killed as a whole process group mid-sync, a producer killed
mid-sync, a replica left undriven for a version (a straggler) and the whole trainer killed mid-sync and replaced by
a new one (a new address and session) that takes the running engines over — with every live engine compared to a
FRESH engine on the version it reports, or refusing to serve because it is torn."""

from __future__ import annotations

import pytest

from shardsync.programs.chaos import run_chaos_vllm

KINDS = ("engine_kill_mid_sync", "producer_kill", "straggler", "trainer_restart")


@pytest.mark.vllm
def test_chaos_with_real_vllm_engines(tmp_path) -> None:
    out = run_chaos_vllm(kills=4, seed=0, kinds=KINDS, workdir=str(tmp_path))
    assert out["faults"] == 4 and out["syncs"] == 5 and out["by_kind"] == {k: 1 for k in KINDS}, out
    assert out["deadlocks"] == 0 and out["torn_served"] == 0 and out["mismatched"] == 0, out
    assert out["compared"] > 0 and out["rejoined_exact"] >= 3, out  # the killed engine, then both after the restart
    assert out["straggler_versions"] == out["straggler_healthy_complete"] == 1, out  # the idle replica dropped
    # the new trainer took both running engines over and its first sync left each complete and exact
    assert out["trainer_restarts"] == out["trainer_restarts_healed"] == 1, out
