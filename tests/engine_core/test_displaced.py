"""A displaced engine never rejoins by itself (issue 35, item 4).

An engine process stopped (SIGSTOP) past its lease and replaced by a new process under the same consumer id is
*displaced*: once resumed — while its replacement lives, or after the replacement died — it does not rejoin (an
undriven member would hold every later version up), says so once (one warning), its heartbeat stops, and its next
``sync`` raises ``ConsumerDisplaced``. A paused engine whose id nobody took still rejoins by itself
(``tests/engine_core/test_reliability.py``, fault "pause"). Pure membership rules first, then real processes.
"""

from __future__ import annotations

import logging
import time

import pytest

from shardsync.engine.consumer.consumer import ConsumerDisplaced
from shardsync.engine.coordinator.membership import Membership
from shardsync.errors import ConsumerDropped, SessionInUse
from shardsync.testing.harness import cluster, cluster_procs
from shardsync.testing.harness.cluster import LocalCluster
from shardsync.testing.harness.cluster_procs import TrainerProc  # noqa: F401 (the children's class, from here)
from shardsync.testing.zoo import ZooConfig

CFG = ZooConfig.qwen3_moe_tiny(layers=2)
LEASE = 2.0


# ---------------------------------------------------------------------- the coordinator's rules (pure)
class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _lapse(ms: Membership, clock: _Clock) -> None:
    clock.t += ms.lease_s + 1
    ms.expire()


def test_a_lapsed_session_whose_id_nobody_took_may_rejoin() -> None:
    clock = _Clock()
    ms = Membership(lease_s=LEASE, clock=clock)
    s = ms.hello("c")
    _lapse(ms, clock)
    with pytest.raises(ConsumerDropped) as e:
        ms.renew_consumer("c", s)
    assert Membership.DISPLACED not in str(e.value) and "must rejoin" in str(e.value)
    assert ms.hello("c", s)  # its rejoin is admitted


@pytest.mark.parametrize("replacement", ["live", "died", "left"])
def test_a_session_whose_id_another_took_is_displaced_and_refused_a_rejoin(replacement: str) -> None:
    clock = _Clock()
    ms = Membership(lease_s=LEASE, clock=clock)
    old = ms.hello("c")
    _lapse(ms, clock)
    new = ms.hello("c")  # a restarted engine under the same id
    if replacement == "died":
        _lapse(ms, clock)
    elif replacement == "left":
        ms.drop("c", new, "said goodbye")
    with pytest.raises(ConsumerDropped) as e:
        ms.renew_consumer("c", old)
    assert Membership.DISPLACED in str(e.value) and "lease expired" in str(e.value), str(e.value)
    with pytest.raises(SessionInUse if replacement == "live" else ConsumerDropped) as e:
        ms.hello("c", old)  # its rejoin (it carries its old session)
    if replacement != "live":
        assert Membership.DISPLACED in str(e.value)
        assert ms.hello("c")  # a fresh engine (no old session) is admitted as before


def test_a_session_replaced_by_its_own_hello_is_not_displaced() -> None:
    clock = _Clock()
    ms = Membership(lease_s=LEASE, clock=clock)
    s1 = ms.hello("c")
    s2 = ms.hello("c", s1)  # the same engine said Hello again (a rejoin racing its heartbeat)
    with pytest.raises(ConsumerDropped) as e:
        ms.renew_consumer("c", s1)  # a stale renewal of the older session
    assert Membership.DISPLACED not in str(e.value)
    _lapse(ms, clock)
    with pytest.raises(ConsumerDropped) as e:
        ms.renew_consumer("c", s2)
    assert Membership.DISPLACED not in str(e.value)
    assert ms.hello("c", s2)


# ---------------------------------------------------------------------- real processes
class ConsumerProc(cluster_procs.ConsumerProc):
    """The harness's zoo consumer, keeping the warnings its process logs (``shardsync.*``)."""

    def __init__(self, *args, **kw) -> None:
        self.logged: list[str] = []
        keep = self.logged

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                keep.append(f"{record.levelname} {record.name}: {record.getMessage()}"
                            + (" [traceback]" if record.exc_info else ""))

        logging.getLogger("shardsync").addHandler(_Keep(logging.WARNING))
        super().__init__(*args, **kw)

    def state(self) -> dict:
        c = self.consumer
        return {"displaced": c.displaced, "rejoins": c.rejoins, "heartbeat_alive": c.heartbeat._thread.is_alive(),
                "logged": list(self.logged)}


def _completed_without(r: dict, survivor: str) -> None:
    """Every producer served the version to the survivor alone: nobody else was a member, nobody was dropped."""
    assert r["exact"], r["failed"]
    for p in r["producers"]:
        assert p["members"] == [survivor] and p["completed"] == [survivor] and not p["dropped"], p


@pytest.mark.procs
@pytest.mark.parametrize("resumed", ["while_replacement_lives", "after_replacement_died"])
def test_a_displaced_engine_does_not_rejoin_says_so_once_and_the_group_goes_on(monkeypatch, resumed: str) -> None:
    monkeypatch.setattr(cluster, "PROCS", __name__)  # the children: TrainerProc and the ConsumerProc above
    victim, survivor = "r1/tp0", "r0/tp0"
    cl = LocalCluster(CFG, producers=2, replicas=2, tp=1, lease_s=LEASE, timeout_s=8 * LEASE,
                      max_chunk_bytes=32 << 10)
    old = None
    with cl:
        try:
            assert cl.sync(1)["exact"]
            old = cl.hosts[victim]  # the first engine process under the id
            old.pause()
            time.sleep(2 * LEASE)  # past its lease
            cl._start_consumers([victim])  # a new engine process, same id (it waits until the old lease lapsed)
            cl._expect({victim: cl.inits.pop(victim)}, "ready")
            if resumed == "while_replacement_lives":
                old.resume()
                time.sleep(LEASE)  # its heartbeat finds another session under its id
            r = cl.sync(2)  # the replacement and the survivor; the old process is not driven
            assert r["exact"], r["failed"]
            assert all(sorted(p["members"]) == [survivor, victim] for p in r["producers"]), r["producers"]
            cl.kill(victim)  # the replacement dies
            time.sleep(2 * LEASE + 1)  # its lease lapses: the id is free again
            if resumed == "after_replacement_died":
                old.resume()
                time.sleep(LEASE)  # a zombie would rejoin now
            for v in (3, 4):  # the group goes on without the dead id: no member that never pulls
                _completed_without(cl.sync(v), survivor)
            st = old.call("state").result(30)
            assert st["displaced"] and st["rejoins"] == 0 and not st["heartbeat_alive"], st
            said = [x for x in st["logged"] if "displaced" in x]
            assert len(said) == 1 and said[0].startswith("WARNING shardsync.consumer"), st["logged"]
            assert "another session" in said[0] and "re-initialise" in said[0], said
            assert not [x for x in st["logged"] if "[traceback]" in x], st["logged"]
            out = old.call("sync", 10).result(30)  # driven again, it refuses at once, typed
            assert out["kind"] == ConsumerDisplaced.__name__ and "re-initialise" in out["error"], out
            assert issubclass(ConsumerDisplaced, ConsumerDropped)
            assert old.call("state").result(30)["logged"] == st["logged"]  # said once
            _completed_without(cl.sync(5), survivor)
        finally:
            if old is not None:
                old.close(10)
