"""Hardening III, connections: a token holder opening many authenticated control connections and leaving them
idle cannot grow a server's threads and descriptors past its caps (the longest idle is cut, a busy one never), and
an idle authenticated connection is closed after ``idle_timeout_s``; a legitimate client still gets through."""

from __future__ import annotations

import threading
import time

from shardsync.engine.protocol import messages as m
from shardsync.engine.protocol.control import ControlClient, ControlServer

from test_wire_hardening import TOKEN, _ack, _wait_for


def _serving(name: str) -> int:
    return sum(t.name == f"shardsync-{name}-conn" for t in threading.enumerate())


def test_idle_authenticated_connections_are_capped_per_address_and_a_legitimate_client_gets_through() -> None:
    srv = ControlServer("127.0.0.1", 0, TOKEN, _ack, name="authflood", max_authed=64, max_authed_per_source=16)
    clients = []
    try:
        for _ in range(200):  # 200 authenticated connections from one address, each then idle
            c = ControlClient(srv.address, TOKEN, peer="flood")
            assert isinstance(c.call(m.Renew(), timeout_s=5), m.Ack)
            clients.append(c)
        assert srv.admission.authed() <= 16, srv.admission.authed()
        assert srv.admission.refused["authed_capacity"] >= 200 - 16
        assert _wait_for(lambda: _serving("authflood") <= 16 + 2), _serving("authflood")
        t0 = time.monotonic()
        legit = ControlClient(srv.address, TOKEN, peer="legit")
        assert isinstance(legit.call(m.Renew(), timeout_s=5), m.Ack) and time.monotonic() - t0 < 2
        assert isinstance(clients[0].call(m.Renew(), timeout_s=5), m.Ack)  # a cut client reconnects on its next call
        legit.close()
    finally:
        for c in clients:
            c.close()
        srv.close()


def test_a_busy_authenticated_connection_is_never_cut_and_idle_ones_time_out() -> None:
    release = threading.Event()

    def slow(msg):
        if isinstance(msg, m.Pending):  # the busy one: its request is answered only when released
            release.wait(10)
        return m.Ack()

    srv = ControlServer("127.0.0.1", 0, TOKEN, slow, name="busy", max_authed=4, max_authed_per_source=2,
                        idle_timeout_s=1.0)
    try:
        busy = ControlClient(srv.address, TOKEN, peer="busy")
        out: list = []
        t = threading.Thread(target=lambda: out.append(busy.call(m.Pending(), timeout_s=10)), daemon=True)
        t.start()
        assert _wait_for(lambda: srv.inflight("Pending") == 1)
        others = [ControlClient(srv.address, TOKEN, peer=f"o{i}") for i in range(5)]
        for c in others:
            c.call(m.Renew(), timeout_s=5)
        release.set()
        t.join(10)
        assert out and isinstance(out[0], m.Ack)  # the busy connection was never the one cut
        assert _wait_for(lambda: srv.admission.authed() == 0, timeout_s=5), srv.admission.authed()  # all idle: closed
        for c in [busy, *others]:
            c.close()
    finally:
        srv.close()


def test_wait_answered_returns_when_the_last_answer_has_gone_out_and_not_before() -> None:
    """A producer lets the answers to releases go out before it returns from a sync (``Producer._drain``): the server
    wakes that wait when an answer is sent (no polling), reports False while one is still being handled, and a kind
    it is not asked about does not hold it."""
    release = threading.Event()

    def slow(msg):
        if isinstance(msg, m.Pending):
            release.wait(10)
        return m.Ack()

    srv = ControlServer("127.0.0.1", 0, TOKEN, slow, name="answered")
    c = ControlClient(srv.address, TOKEN, peer="c")
    try:
        out: list = []
        t = threading.Thread(target=lambda: out.append(c.call(m.Pending(), timeout_s=10)), daemon=True)
        t.start()
        assert _wait_for(lambda: srv.inflight("Pending") == 1)
        assert srv.wait_answered("Pending", timeout_s=0.2) is False
        assert srv.wait_answered("Released", timeout_s=0.2) is True  # only the kinds asked about count
        threading.Timer(0.3, release.set).start()
        t0 = time.monotonic()
        assert srv.wait_answered("Pending", timeout_s=5) is True
        assert 0.2 < time.monotonic() - t0 < 2
        t.join(5)
        assert out and isinstance(out[0], m.Ack) and srv.inflight() == 0
    finally:
        c.close()
        srv.close()
