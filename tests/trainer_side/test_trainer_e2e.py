"""Sharded trainers through the engine, real processes and real gloo collectives. Megatron-style TP2 x PP2 dense
and EP2 x PP2 MoE producer processes (gloo TP groups, Megatron layouts, ``MegatronSource``) -> one TP2 zoo
replica, 3 syncs with new weights each, every consumer byte-exact; each rank gathers exactly the HF tensors it
holds (no tensor across PP, no expert across EP); gather and receive budgets hold. An FSDP2 reference trainer
really training between syncs. Non-blocking syncs under in-place weight changes."""

from __future__ import annotations

import time

import pytest

from shardsync.sources.megatron_layout import MegatronConfig, MegatronParallel, held_hf_names
from shardsync.testing.harness.trainers import megatron_coords
from shardsync.testing.harness.cluster import LocalCluster
from shardsync.types import itemsize
from shardsync.testing.zoo import ZooConfig, hf_shapes

from helpers import free_port

GATHER_BUDGET = 600_000
RECV_BUDGET = 3_000_000
pytestmark = pytest.mark.procs


CASES = {
    "tp2xpp2-dense": (ZooConfig(layers=4, qk_norm=True, ckpt_dtype="float32", dtype="float32"), {"tp": 2, "pp": 2}),
    "ep2xpp2-moe": (ZooConfig.qwen3_moe_tiny(layers=4, experts=4, ckpt_dtype="float32", dtype="float32"),
                    {"ep": 2, "pp": 2}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_trainer_to_tp2_replica_exact_with_local_gathers_and_budgets(case: str) -> None:
    zc, par = CASES[case]
    n = par.get("tp", 1) * par.get("ep", 1) * par.get("pp", 1)
    spec = {"kind": "megatron", "cfg": zc.__dict__, "par": par, "dist_port": free_port()}
    mcfg = MegatronConfig.like(zc, dtype=zc.ckpt_dtype)
    shapes = hf_shapes(zc)
    expect = []
    for r in range(n):
        mp = MegatronParallel(tp=par.get("tp", 1), pp=par.get("pp", 1), ep=par.get("ep", 1),
                              **megatron_coords(par, r))
        held = held_hf_names(mcfg, mp)
        expect.append(sum(itemsize(zc.ckpt_dtype) * _numel(shapes[x]) for x in held))
    with LocalCluster(zc, producers=n, replicas=1, tp=2, spec=spec, max_chunk_bytes=64 << 10, timeout_s=90,
                      producer_extra={"gather_budget_bytes": GATHER_BUDGET},
                      consumer_extra={"recv_budget_bytes": RECV_BUDGET}) as cl:
        for v in (1, 2, 3):
            r = cl.sync(v)
            assert r["exact"], r["consumers"]
            for rank, p in enumerate(r["producers"]):
                assert p["gathered_bytes"] == expect[rank], (rank, p["gathered_bytes"], expect[rank])
                assert p["peak_gathered_bytes"] <= GATHER_BUDGET
            for c in r["consumers"]:
                assert c["recv_bytes"] <= RECV_BUDGET and c["recv_slots_used"] >= 1
                assert len(c["pulled_from"]) >= 2  # both PP stages at once, not one after the other
        assert sum(p["bytes_sent"] for p in r["producers"]) > 0


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_a_gather_budget_below_one_group_is_refused_at_init() -> None:
    zc = ZooConfig(layers=2, ckpt_dtype="float32", dtype="float32")
    with pytest.raises(RuntimeError, match="gather_budget_bytes"):
        LocalCluster(zc, producers=1, replicas=1, tp=1, timeout_s=30, producer_extra={"gather_budget_bytes": 1000})


def test_non_blocking_sync_serves_the_snapshot_while_training_changes_the_weights() -> None:
    """``sync(v, block=False)`` returns after the lockstep gathers; the producers then change their weights (the
    next optimizer step) while consumers pull: every consumer still holds version v exactly."""
    zc, par = CASES["tp2xpp2-dense"]
    spec = {"kind": "megatron", "cfg": zc.__dict__, "par": par, "dist_port": free_port()}
    with LocalCluster(zc, producers=4, replicas=1, tp=2, spec=spec, max_chunk_bytes=64 << 10, timeout_s=90) as cl:
        for v in (1, 2):
            r = cl.sync(v, faults={p: {"nonblocking": True} for p in range(4)})
            assert r["exact"], r["consumers"]
            assert all(p["snapshot_bytes"] > 0 and p["completed"] for p in r["producers"])
        r = cl.sync(3)  # and a blocking one after
        assert r["exact"] and all(p["snapshot_bytes"] == 0 for p in r["producers"])


def test_fsdp2_trainer_really_training_to_tp2_replica_exact_every_sync(tmp_path) -> None:
    """2 FSDP2 ranks of the reference trainer (forward, backward, AdamW between syncs) -> a TP2 replica: every
    sync exact against the weights the trainer holds after that step; lockstep: each rank runs one collective
    per gather group per sync (every group on every rank: FSDP shards everything) and no more."""
    zc = ZooConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64, inter=128, qk_norm=True,
                   dtype="float32", ckpt_dtype="float32")  # the reference trainer's tiny Qwen3, as zoo consumers
    spec = {"kind": "fsdp", "arch": "qwen3", "dir": str(tmp_path), "dist_port": free_port()}
    with LocalCluster(zc, producers=2, replicas=1, tp=2, spec=spec, max_chunk_bytes=64 << 10, timeout_s=90) as cl:
        prev = [0, 0]
        for v in (1, 2, 3):
            r = cl.sync(v)
            assert r["exact"], r["consumers"]
            for rank, p in enumerate(r["producers"]):
                groups = p["gather_batches"]
                assert p["source_stats"]["collectives"] - prev[rank] == groups, (rank, p["source_stats"], groups)
                prev[rank] = p["source_stats"]["collectives"]
                assert p["bytes_sent"] > 0  # both ranks serve: routing splits the work
        first, last = _load(tmp_path, 1), _load(tmp_path, 3)
        assert any(not first[k].equal(last[k]) for k in first)  # the weights really changed between syncs


def test_a_rank_that_cannot_start_a_sync_leaves_no_peer_in_a_gather(tmp_path) -> None:
    """FSDP2 (every group a collective on both ranks): rank 1 cannot start version 2 (its engines gone). It still
    runs its lockstep gathers, so rank 0 leaves its own; version 2 fails for everyone, typed and within bounds (not
    a hang), and version 3 is exact — both ranks having run exactly one collective per group per version."""
    zc = ZooConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64, inter=128, qk_norm=True,
                   dtype="float32", ckpt_dtype="float32")
    spec = {"kind": "fsdp", "arch": "qwen3", "dir": str(tmp_path), "dist_port": free_port()}
    with LocalCluster(zc, producers=2, replicas=1, tp=2, spec=spec, max_chunk_bytes=64 << 10, timeout_s=30) as cl:
        assert cl.sync(1)["exact"]
        t0 = time.monotonic()
        r = cl.sync(2, faults={1: {"fail_at_begin": True}}, tolerate=True)
        assert time.monotonic() - t0 < 45, time.monotonic() - t0  # under 2 x timeout_s: nobody hung in a gather
        assert "injected: producer 1 cannot start version 2" in r["failed"]["1"], r["failed"]
        assert {"0", "r0/tp0", "r0/tp1"} <= set(r["failed"]), r["failed"]
        r = cl.sync(3)
        assert r["exact"], r["consumers"]
        for p in r["producers"]:  # versions 1, 2 (failed, drained) and 3: one collective per group each
            assert p["source_stats"]["collectives"] == 3 * p["gather_batches"], p["source_stats"]


def _load(d, v: int) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{d}/v{v}.safetensors")
