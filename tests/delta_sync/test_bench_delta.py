"""``shardsync bench --delta`` (issue 27): the reference RL-rate trainer into a real vLLM engine, delta sync against
dense sync over the same versions, every sync compared with a fresh load; the CLI's JSON contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_bench_delta_reads_fewer_bytes_and_every_sync_equals_a_fresh_load():
    proc = subprocess.run([sys.executable, "-m", "shardsync.cli", "bench", "--delta", "--syncs", "2", "--json"],
                          capture_output=True, text=True, timeout=850, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]  # --json: stdout carries only the JSON line
    out = json.loads(lines[0])
    assert list(out)[:7] == ["syncs", "dense_bytes", "delta_bytes", "changed_fraction", "seconds_dense",
                             "seconds_delta", "exact"]  # the summary fields, in its order
    assert out["syncs"] == 2 and out["exact"] is True
    assert out["lr"] == 1e-6 and 0 < out["changed_fraction"] < 0.2
    delta, dense = out["delta"], out["dense"]
    assert [r["version"] for r in delta] == [r["version"] for r in dense] == [1, 2, 3]
    assert all(r["exact"] for r in delta + dense)  # every sync of both passes equal to a fresh load of its version
    assert delta[-1]["fresh_engine_exact"] is True and delta[-1]["fresh_engine_compared"] > 20
    model = dense[0]["applied_bytes"]
    assert all(r["wire_bytes"] == r["applied_bytes"] == model for r in dense)  # dense: every packed byte, each sync
    assert delta[0]["wire_bytes"] == model and delta[0]["producer_delta_offered"] == 0  # first sync: no base
    for r in delta[1:]:  # later syncs: only payloads cross the wire; the engine still applies every byte
        assert r["applied_bytes"] == model and 0 < r["wire_bytes"] * 5 < model, r
        # the directly written layers are the deltas' base themselves, not held twice
        assert r["live_bytes"] > 0 and r["held_bytes"] + r["live_bytes"] >= model > r["held_bytes"], r
        assert r["producer_delta_payload_bytes"] == r["wire_bytes"], r
        assert model <= r["producer_history_bytes"] < model * 1.01, r  # the trainer keeps the bases once, no journal
        assert 0 < r["producer_delta_area_need_bytes"] <= r["producer_delta_area_bytes"], r  # every payload fit
    # version 2's deltas sized the delta areas (a quarter of a slot at first): kept where they needed over a quarter
    # of it, else shrunk (and the ring with them) for version 3
    v2, v3 = delta[1], delta[2]
    a2, n2, ring2 = v2["producer_delta_area_bytes"], v2["producer_delta_area_need_bytes"], v2["producer_ring_bytes"]
    a3, ring3 = v3["producer_delta_area_bytes"], v3["producer_ring_bytes"]
    assert (a3 == a2 and ring3 == ring2) if 4 * n2 >= a2 else (2 * n2 <= a3 < a2 and ring3 < ring2), delta
    assert out["dense_bytes"] == model and out["delta_bytes"] * 5 < model
    assert out["first_sync_bytes"] == {"dense": model, "delta": model}
