"""Hardening III, membership: only a member pulling from a producer can fail a version for it being lost, and only
the producer rank itself (its incarnation's credential) can fail a version with ``SyncFailed`` or drop a member as a
straggler. Real sockets: the ``pair`` of ``test_wire_hardening.py``, the attacker a token holder's connection."""

from __future__ import annotations

import pytest

from shardsync.engine.protocol import messages as m
from shardsync.engine.protocol.control import ControlClient
from shardsync.errors import AuthError

from test_wire_hardening import TOKEN, _sync2, pair  # noqa: F401  (the fixture)


def test_a_peer_that_only_said_hello_cannot_fail_versions_by_abandoning_them(pair) -> None:  # noqa: F811
    """A bare Hello (no plan) abandons the next versions 'because producer 0 was lost': its own abandons are
    recorded, and every one of those versions completes for the real consumer, exact."""
    p0, p1, z = pair
    c = ControlClient(p0.address, TOKEN, peer="coordinator")
    try:
        w = c.call(m.Hello(consumer="outsider"), timeout_s=10)
        nxt = max(p1.versions) + 1
        for v in range(nxt, nxt + 3):
            c.call(m.Abandon(consumer="outsider", session=w.session, version=v, reason="lost it",
                             lost_producer=0), timeout_s=10)
        for v in range(nxt, nxt + 3):
            stats = _sync2(p0, p1, [z], v)  # completed, nothing dropped, exact (checked there)
            assert stats["completed"] == ["r0/tp0"], stats
    finally:
        c.close()


def test_a_spoofed_sync_failed_or_straggler_report_is_refused(pair) -> None:  # noqa: F811
    """``SyncFailed`` / ``Straggler`` naming rank 0 or 1 and its current incarnation but not its credential are
    refused (``AuthError``) and change nothing: the next version completes, exact."""
    p0, p1, z = pair
    c = ControlClient(p0.address, TOKEN, peer="coordinator")
    nxt = max(p1.versions) + 1
    try:
        for rank, inc in ((0, p0.incarnation), (1, p1.incarnation)):
            for cred in ("", "0" * 32):
                with pytest.raises(AuthError, match=f"producer {rank}: the credential"):
                    c.call(m.SyncFailed(rank=rank, version=nxt, reason="spoofed", incarnation=inc, credential=cred),
                           timeout_s=10)
                with pytest.raises(AuthError):
                    c.call(m.Straggler(rank=rank, incarnation=inc, version=nxt, consumer="r0/tp0",
                                       session=z.c.session, reason="spoofed", credential=cred), timeout_s=10)
    finally:
        c.close()
    assert p0.credential and p1.credential and p0.credential != p1.credential
    _sync2(p0, p1, [z], nxt)


def test_junk_hellos_during_init_do_not_fail_it() -> None:
    """During init a token holder says Hello as 'junk' then InitFailed, and as 'lapsed' lets its lease expire:
    neither counts against the quorum of registered plans; the two real consumers, starting after them but within
    the join grace, are routed and the first sync is exact."""
    import threading
    import time

    from test_wire import _Zoo, _catch, _close, _producer, _start, _sync

    p, th, err = _producer(2, join_grace_s=30.0, lease_s=2.0)  # the grace is long: routing needs no wait for it
    c = ControlClient(p.address, TOKEN, peer="coordinator")
    hello = threading.Thread(target=lambda: _catch(lambda: c.call(m.Hello(consumer="lapsed"), timeout_s=20), []),
                             daemon=True)
    hello.start()  # answered once every producer joined; then its lease lapses (no heartbeat)
    hello.join(20)
    c2 = ControlClient(p.address, TOKEN, peer="coordinator")
    w = c2.call(m.Hello(consumer="junk"), timeout_s=20)
    c2.call(m.InitFailed(consumer="junk", session=w.session, reason="junk"), timeout_s=10)
    time.sleep(4.5)  # the lapsed lease expires
    zoos = [_Zoo(p.address, "r0/tp0"), _Zoo(p.address, "r1/tp0")]
    try:
        _start(zoos)
        th.join(30)
        assert not err, err
        stats, errs = _sync(p, zoos, 1)
        assert not errs and all(z.exact(1) for z in zoos), errs
        assert stats["completed"] == ["r0/tp0", "r1/tp0"], stats
    finally:
        c.close()
        c2.close()
        _close(p, zoos)


def test_an_evicted_consumer_rejoins_at_its_next_sync_and_takes_part_in_it() -> None:
    """Evicted at the coordinator (its lease lapsed) just before a version, with its heartbeat not due yet: its
    ``BeginSync`` is refused as dropped, it rejoins at once and takes part in that same version (the version had
    not begun), exact — it does not miss it."""
    import threading
    import time

    from test_wire import _Zoo, _catch, _close, _producer, _start, _sync

    p, th, err = _producer(1, lease_s=10.0)  # renewals a few seconds apart: the sync is first to learn
    z = _Zoo(p.address, "r0/tp0")
    try:
        _start([z])
        th.join(30)
        assert not err, err
        _, errs = _sync(p, [z], 1)
        assert not errs and z.exact(1)
        co = p.coordinator
        with co.cv:
            co.ms.drop("r0/tp0", z.c.session, "lease expired: no heartbeat (injected)")
        got: list = []
        t = threading.Thread(target=lambda: _catch(lambda: got.append(z.c.sync(2)), got), daemon=True)
        t.start()
        time.sleep(0.5)  # the consumer asks first: the version begins with it as a member again
        p.source.at(2)
        stats = p.sync(2)
        t.join(30)
        assert got and isinstance(got[0], dict), got
        assert stats["completed"] == ["r0/tp0"] and z.exact(2) and z.c.rejoins == 1, (stats, z.c.rejoins)
    finally:
        _close(p, [z])
