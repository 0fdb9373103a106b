"""A straggler never fails the others: real processes, a live member that stops pulling.

A member whose lease stays live but that does not pull (an idle engine the framework did not drive, a worker hung
mid-pull) is dropped from that version once it held a group ``straggler_s`` past its announcement; every other
member completes the version exact, the trainer's result names who completed and who was dropped (and why), the
straggler is torn only if it had applied part of the version, and it is exact at the next version it takes part in
(dense where delta sync has no base for it).
"""

from __future__ import annotations

import pytest

from shardsync.testing.harness.cluster import LocalCluster
from shardsync.testing.zoo import ZooConfig

CFG = ZooConfig.qwen3_moe_tiny(layers=3)
LEASE = 2.0
STRAGGLER = 4.0
pytestmark = pytest.mark.procs
VICTIM, SURVIVOR = "r1/tp0", "r0/tp0"


def _cluster(**kw) -> LocalCluster:
    return LocalCluster(CFG, producers=2, replicas=2, tp=1, lease_s=LEASE, timeout_s=8 * LEASE,
                        max_chunk_bytes=32 << 10, producer_extra={"straggler_s": STRAGGLER}, **kw)


def _dropped_as_straggler(r: dict) -> None:
    """Every producer's result: the survivor completed the version, the victim was dropped as a straggler."""
    for p in r["producers"]:
        assert SURVIVOR in p["completed"] and VICTIM not in p["completed"], p
        assert "straggler" in p["dropped"].get(VICTIM, ""), p["dropped"]
        assert p["held_bytes"] == 0, p


@pytest.mark.parametrize("delta", [False, True], ids=["dense", "delta"])
def test_idle_member_is_dropped_others_complete_then_it_catches_up(delta: bool) -> None:
    """The victim is registered and renews its lease but is never asked to sync version 2 (an engine busy
    generating): version 2 completes for the survivor; at version 3 the victim, still on version 1, is exact."""
    with _cluster(delta=delta) as cl:
        assert cl.sync(1)["exact"]
        r = cl.sync(2, skip={VICTIM}, tolerate=True)
        assert not r["failed"], r["failed"]
        assert [c["consumer"] for c in r["consumers"]] == [SURVIVOR] and r["exact"], r["consumers"]
        _dropped_as_straggler(r)
        r = cl.sync(3, tolerate=True)
        assert r["exact"], [(c["consumer"], c.get("error"), c["mismatched"][:3]) for c in r["consumers"]]


def test_member_hung_mid_pull_is_dropped_torn_only_if_it_applied() -> None:
    """The victim stops after its second chunk read for longer than ``straggler_s`` while its heartbeat goes on:
    the survivor completes exact; the victim's late pull or release is refused (ConsumerDropped), it says whether
    it is torn (and then serves nothing), and the next version heals it."""
    with _cluster() as cl:
        assert cl.sync(1)["exact"]
        r = cl.sync(2, faults={VICTIM: {"stall_at_chunk": 2, "stall_s": 3 * STRAGGLER}}, tolerate=True)
        by = {c["consumer"]: c for c in r["consumers"]}
        assert by[SURVIVOR]["exact"], by[SURVIVOR]
        late = by[VICTIM]
        assert late.get("kind") == "ConsumerDropped" and "straggler" in late["error"], late
        s = late["state"]  # fail closed: torn by its own account, or still exactly on version 1
        assert s["torn"] or (s["version"] == 1 and not s["mismatched"]), s
        assert s["torn"] == late["torn"]
        assert set(r["failed"]) == {VICTIM}, r["failed"]
        _dropped_as_straggler(r)
        r = cl.sync(3, tolerate=True)
        assert r["exact"], [(c["consumer"], c.get("error"), c["mismatched"][:3]) for c in r["consumers"]]


def test_chaos_stragglers_never_fail_the_healthy() -> None:
    """``shardsync chaos --kinds straggler``: every version a straggler was dropped from completes, exact, on every
    other consumer; no deadlock, nothing torn served or mismatched, the stragglers exact at their next sync."""
    from shardsync.programs.chaos import run_chaos

    out = run_chaos(kills=3, seed=5, replicas=2, tp=1, lease_s=LEASE, cfg=CFG, kinds=("straggler",))
    assert out["by_kind"] == {"straggler": 3} and out["syncs"] == 4, out
    assert out["deadlocks"] == 0 and out["torn_served"] == 0 and out["mismatched"] == 0, out
    assert out["unexpected_failures"] == 0 and out["lost_bytes"] == 0 and out["rejoined_mismatched"] == 0, out
    assert out["straggler_versions"] == out["straggler_healthy_complete"] == 3, out
    assert out["rejoined_exact"] >= 1, out
