"""Reliability with real processes: kill -9 / SIGSTOP of consumers and producers while syncs go on.

Survivors stay bit-exact, the dead are dropped within the lease bound (named, with the reason),
rejoiners are exact at their next sync, a producer's death fails the sync with a typed error naming it
and engines keep their last complete version (or say they are torn), and nothing is left behind.
"""

from __future__ import annotations

import threading
import time

import pytest

from shardsync.programs.chaos import run_chaos
from shardsync.testing.harness.cluster import LocalCluster
from shardsync.testing.zoo import ZooConfig

CFG = ZooConfig.qwen3_moe_tiny(layers=3)
LEASE = 2.0
BOUND = 2 * LEASE + 1.0  # lease + renew period + poll slice, with room for a loaded 2-core machine
pytestmark = pytest.mark.procs


def _cluster(**kw) -> LocalCluster:
    return LocalCluster(CFG, producers=2, replicas=2, tp=1, lease_s=LEASE, timeout_s=8 * LEASE,
                        max_chunk_bytes=32 << 10, **kw)


def _all_exited(cl: LocalCluster) -> bool:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(p.is_alive() for p in cl.procs.values()):
        time.sleep(0.1)
    return not any(p.is_alive() for p in cl.procs.values())


@pytest.mark.parametrize("fault", ["kill_between", "kill_mid_pull", "kill_mid_apply", "pause", "restart"])
def test_dead_or_paused_consumer_is_dropped_survivor_exact_rejoiner_exact(fault: str) -> None:
    victim, survivor = "r1/tp0", "r0/tp0"
    cl = _cluster()
    with cl:
        assert cl.sync(1)["exact"]
        faults, t_fault = {}, None
        if fault == "kill_between":
            t_fault = cl.kill(victim)
        elif fault == "kill_mid_pull":
            faults = {victim: {"die_at_chunk": 2}}
        elif fault == "kill_mid_apply":
            faults = {victim: {"die_at_apply": 2}}
        elif fault == "pause":  # stopped past its lease; resumed while the others finish the sync
            t_fault = cl.pause(victim)
            threading.Timer(3 * LEASE, cl.resume, (victim,)).start()
        else:
            cl.kill(victim)
            cl.restart(victim)  # same id, at once: the old session is replaced, not waited for
        r = cl.sync(2, faults=faults, tolerate=True)
        by = {c["consumer"]: c for c in r["consumers"]}
        assert by[survivor]["exact"], by[survivor]
        if fault == "restart":
            assert by[victim]["exact"], by[victim]
        else:
            assert victim not in by or not by[victim]["exact"]
            dropped = [p["dropped"] for p in r["producers"] if victim in p.get("dropped", {})]
            assert dropped, r["producers"]  # the result names who was dropped, and why
            assert all("lease expired" in d[victim] for d in dropped), dropped
            t0 = t_fault if t_fault is not None else cl.died_at(victim)
            detect = max(p["dropped_at"][victim] for p in r["producers"] if victim in p["dropped_at"]) - t0
            assert 0 < detect < BOUND, detect
            assert all(p["held_bytes"] == 0 for p in r["producers"]), r["producers"]
            if fault == "pause":
                time.sleep(LEASE)  # its heartbeat found the lease expired and rejoined with a new session
            else:
                cl.restart(victim)
        r = cl.sync(3, tolerate=True)
        assert r["exact"], [(c["consumer"], c.get("error"), c["mismatched"][:3]) for c in r["consumers"]]
        if fault == "pause":
            assert [c for c in r["consumers"] if c["consumer"] == victim][0]["rejoins"] >= 1
    assert _all_exited(cl)


def test_producer_killed_mid_sync_fails_typed_then_restarted_producer_serves_exact() -> None:
    cl = _cluster()
    with cl:
        assert cl.sync(1)["exact"]
        for v in (2, 4):  # twice: a restart quicker than the lease must not be mistaken for its predecessor's death
            t0 = time.monotonic()
            r = cl.sync(v, faults={1: {"die_after_groups": 1}}, tolerate=True)
            assert time.monotonic() - t0 < BOUND + 10
            for c in r["consumers"]:
                assert c["kind"] == "ProducerLost" and "producer 1" in c["error"], c
                s = c["state"]  # fail closed: either it still holds the last version exactly, or it says it is torn
                assert s["torn"] or (s["version"] == v - 1 and not s["mismatched"]), s
            p0 = r["producers"][0]
            assert p0["kind"] in ("ProducerLost", "SyncError") and "producer 1" in p0["error"], p0
            assert p0["held_bytes"] == 0
            cl.restart(1)  # same rank, same coordinator address
            r = cl.sync(v + 1, tolerate=True)
            assert r["exact"], r["failed"]
    assert _all_exited(cl)


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_coordinator_death_fails_the_others_fast(fault: str) -> None:
    """Killed, or stopped (SIGSTOP: its sockets stay open, nothing answers): every other peer fails the next sync
    within the lease bound (not after ``timeout_s``), naming the coordinator."""
    cl = _cluster()
    with cl:
        assert cl.sync(1)["exact"]
        getattr(cl, fault)(0)
        t0 = time.monotonic()
        r = cl.sync(2, tolerate=True, skip={0} if fault == "pause" else ())
        assert time.monotonic() - t0 < BOUND + 10  # < timeout_s (16 s): the lease bound, not the sync timeout
        if fault == "pause":
            cl.kill(0)
        assert set(r["failed"]) == {"1", "r0/tp0", "r1/tp0"}, r["failed"]
        for k, e in r["failed"].items():
            assert "coordinator" in e or "producer 0" in e, (k, e)
    assert _all_exited(cl)


def test_chaos_wire_attacks_each_bounded_beside_an_exact_sync() -> None:
    """Floods, dripped handshakes, 20 MB reasons, forged Abandons to every producer, amplifying plans, the budget
    attacks (copies in one group, a whole-model gather, 100k scatters) and a non-member abandoning versions for a
    lost producer: each during a sync that every consumer completes exact."""
    from shardsync.testing.harness.attacks import BOUNDED

    out = run_chaos(kills=9, seed=2, replicas=2, tp=1, lease_s=LEASE, cfg=CFG, kinds=BOUNDED)  # all seven
    assert set(out["by_kind"]) == set(BOUNDED), out["by_kind"]
    assert out["deadlocks"] == 0 and out["torn_served"] == 0 and out["mismatched"] == 0
    assert out["unexpected_failures"] == 0 and out["syncs_completed"] == out["syncs"] == 10, out


def test_chaos_short_run_all_fault_kinds() -> None:
    out = run_chaos(kills=9, seed=3, replicas=2, tp=1, lease_s=LEASE, cfg=CFG,
                    kinds=("kill_between", "kill_mid_pull", "kill_mid_apply", "pause", "producer_kill", "restart",
                           "forged_plan", "wrong_token", "oversized_frame"))
    assert out["faults"] == 9 and out["syncs"] == 10
    assert out["deadlocks"] == 0 and out["torn_served"] == 0 and out["mismatched"] == 0
    assert out["rejoined_mismatched"] == 0 and out["unexpected_failures"] == 0 and out["lost_bytes"] == 0
    assert out["syncs_completed"] >= 1 and out["rejoined_exact"] >= 1
    assert out["max_detect_s"] < BOUND
