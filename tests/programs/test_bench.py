"""The broadcast baseline (``programs/baseline.py``, the only one) loads what it times: every baseline sync leaves each
consumer holding the broadcast version, byte for byte, like a shardsync sync; ``shardsync bench`` reports both
paths bit-exact; ``benchmarks/gpu_sync.py`` (on CPU) checks its baselines the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import free_port

from shardsync.programs.baseline import chunks, owners
from shardsync.programs.bench import replica_paths, run_bench
from shardsync.testing.harness.cluster import LocalCluster
from shardsync.types import ParamMeta
from shardsync.testing.zoo import ZooConfig

pytestmark = pytest.mark.procs
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def test_chunks_keep_one_owner_and_the_bucket_cap() -> None:
    metas = [ParamMeta(name=f"t{i}", dtype="float32", shape=(n,)) for i, n in enumerate((4, 4, 4, 16, 4, 4))]
    owner = owners([["t0", "t1", "t2", "t3"], ["t4", "t5"]], metas)
    assert [(p, [m.name for m in ms]) for p, ms in chunks(metas, owner)] == [(0, ["t0"]), (0, ["t1"]), (0, ["t2"]),
                                                                             (0, ["t3"]), (1, ["t4"]), (1, ["t5"])]
    got = [(p, [m.name for m in ms]) for p, ms in chunks(metas, owner, bucket_bytes=32)]
    assert got == [(0, ["t0", "t1"]), (0, ["t2"]), (0, ["t3"]), (1, ["t4", "t5"])]  # 64 B alone; never across owners
    with pytest.raises(ValueError, match="no producer holds"):
        owners([["t0"]], metas)


def test_every_baseline_sync_is_exact() -> None:
    """Baseline and shardsync syncs interleaved: after each, every consumer holds that version, every byte
    compared with its own loaders on the trainer's full tensors of it."""
    with LocalCluster(ZooConfig.qwen3_moe_tiny(layers=2), producers=2, replicas=1, tp=2, baseline=True,
                      timeout_s=60) as cl:
        for v, base in ((1, True), (2, False), (3, True), (4, True), (5, False)):
            r = cl.sync(v, baseline=base)
            for c in r["consumers"]:
                assert c["state"]["version"] == v and c["mismatched"] == [] and c["exact"], (v, base, c)
            assert r["exact"], (v, base, r)


def test_bench_reports_both_paths_bit_exact(capsys) -> None:
    out = run_bench(model="qwen3-moe-tiny", producers=2, replicas=1, tp=2, syncs=1)
    assert out["shardsync_exact"] is True and out["baseline_exact"] is True and out["exact"] is True, out
    assert out["shardsync_s"] > 0 and out["baseline_s"] > 0, out
    assert "bit-exact: yes (shardsync yes, baseline yes)" in capsys.readouterr().out


def test_vllm_bench_paths_split_replicas_and_refuse_bad_choices() -> None:
    """``bench --consumers vllm --paths``: both alternates (even replicas direct) so each path is timed in the same
    rounds; a path with no replica of its own, or an unknown one, is refused before any engine starts."""
    assert replica_paths("both", 4) == [True, False, True, False]
    assert replica_paths("direct", 2) == [True, True] and replica_paths("general", 3) == [False] * 3
    with pytest.raises(ValueError, match="at least 2 replicas"):
        replica_paths("both", 1)
    with pytest.raises(ValueError, match="expected both, direct or general"):
        replica_paths("fast", 2)


def _gpu_sync_on_cpu(tmp_path, scenario: str, layers: int, experts: int) -> dict:
    """``benchmarks/gpu_sync.py`` on CPU over tcp, one iteration: its JSON for ``scenario``."""
    p = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_sync.py"), "--device", "cpu", "--layers", str(layers),
                        "--experts", str(experts), "--scenarios", scenario, "--transports", "tcp", "--iters", "1",
                        "--port", str(free_port()), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.load(open(tmp_path / "gpu_sync.json"))[scenario]


def test_gpu_benchmark_baselines_exact_on_cpu(tmp_path) -> None:
    a = _gpu_sync_on_cpu(tmp_path, "A", 1, 4)
    assert a["exact"] and a["baseline_exact"], a["baseline_checked"]
    assert all(c["compared"] > 10 for r in a["baseline_checked"].values() for c in r.values()), a["baseline_checked"]


def test_gpu_benchmark_engine_exact_on_cpu_with_split_layers(tmp_path) -> None:
    """Scenario B on CPU over tcp: the zoo engines record their layers in parts (the default sync memory budget is a
    tenth of this tiny model) and run the FP8 process step once every part of a layer is in: exact, kernel tensors
    included."""
    b = _gpu_sync_on_cpu(tmp_path, "B", 2, 16)
    assert b["tcp"]["exact"], b["tcp"]
