"""Hardening II: no unauthenticated peer, buggy engine or hostile token holder stops, bloats or hangs the group.

Each attack runs against real sockets (a producer and zoo consumers as threads of this process, or a server in a
child process with a lowered file limit), and a legitimate call or sync beside it must still complete — exact:

* accept loops survive ``EMFILE`` and other transient errors (and go on serving once the flood has left);
* idle unauthenticated connections are capped (the oldest is cut) and a legitimate client still gets through;
* a handshake dripped a byte at a time is cut at ONE wall-clock deadline;
* 90 MB reasons are clipped where received; heartbeat replies stay small whatever was sent;
* a forged ``Abandon`` (wrong session) sent to a producer of rank >= 1 drops nobody; ones for far versions are refused;
* plans of consumers that left are pruned, and all routed plans together have a budget (naming the consumer);
* the token never shows in a ``repr``.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from shardsync.engine.protocol import messages as m
from shardsync.engine.protocol.control import ControlClient, ControlServer
from shardsync.engine.producer.producer import Producer, ProducerConfig
from shardsync.errors import PlanError, SyncError
from shardsync.testing.harness.attacks import forged_plan
from shardsync.security.admission import Admission, accept_loop
from test_wire import CFG, TOKEN, _catch, _Source, _start, _sync, _Zoo
from shardsync.testing.zoo import hf_state_dict


def _ack(msg: m.Msg) -> m.Msg:
    return m.Ack()


def _wait_for(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.02)
    return pred()


# ------------------------------------------------------------------------------------------- accept loops
def test_the_accept_loop_survives_emfile_and_other_transient_errors() -> None:
    a, b = socket.socketpair()

    class Flaky:  # a listening socket out of file descriptors, then reset connections, then a good one
        n = 0

        def accept(self):
            self.n += 1
            if self.n <= 3:
                raise OSError(errno.EMFILE, "Too many open files")
            if self.n == 4:
                raise OSError(errno.ECONNABORTED, "Software caused connection abort")
            if self.n == 5:
                return a, ("127.0.0.1", 1)
            time.sleep(0.01)
            raise socket.timeout()

    served: list = []
    closed, adm = threading.Event(), Admission("flaky")
    th = threading.Thread(target=accept_loop, args=(Flaky(), closed, served.append, "flaky", adm), daemon=True)
    th.start()
    assert _wait_for(lambda: served == [a]), served
    closed.set()
    th.join(5)
    adm.close()
    assert not th.is_alive() and adm.refused["accept_error"] == 4, dict(adm.refused)
    a.close(), b.close()


EMFILE_SERVER = r"""
import json, os, resource, sys
from shardsync.engine.protocol import messages as m
from shardsync.engine.protocol.control import ControlServer
srv = ControlServer("127.0.0.1", 0, "tok", lambda msg: m.Ack(), auth_timeout_s=30.0, name="emfile",
                    max_pending=100000, max_per_source=100000)   # no caps: this process runs out of descriptors
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 12, hard))
print(json.dumps(srv.address), flush=True)
sys.stdin.readline()
print(json.dumps(dict(srv.admission.refused)), flush=True)
sys.stdin.readline()
"""


@pytest.mark.procs
def test_a_server_out_of_file_descriptors_serves_again_once_the_flood_leaves() -> None:
    proc = subprocess.Popen([sys.executable, "-c", EMFILE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        addr = json.loads(proc.stdout.readline())
        flood = [socket.create_connection(tuple(addr), timeout=5) for _ in range(60)]  # idle, never authenticate
        time.sleep(1.5)  # the server's accept has failed with EMFILE by now (backing off, not stopping)
        for s in flood:
            s.close()
        time.sleep(0.5)
        c = ControlClient(addr, "tok", peer="emfile server")  # a legitimate client, after the flood
        assert isinstance(c.call(m.Renew(), timeout_s=10), m.Ack)
        c.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        refused = json.loads(proc.stdout.readline())
        assert refused.get("accept_error", 0) > 0, refused  # it did run out, and survived
    finally:
        proc.kill()
        proc.wait()
    assert "accept failed" in proc.stderr.read()  # logged (rate-limited), not silent


def test_idle_unauthenticated_connections_are_capped_and_a_legitimate_client_gets_through() -> None:
    srv = ControlServer("127.0.0.1", 0, TOKEN, _ack, auth_timeout_s=20.0, name="flood")
    flood = []
    try:
        for _ in range(300):
            flood.append(socket.create_connection(tuple(srv.address), timeout=5))
        assert _wait_for(lambda: srv.admission.refused["capacity"] >= 300 - srv.admission.max_per_source)
        assert srv.admission.pending() <= srv.admission.max_per_source  # one source (loopback): its cap
        def serving() -> int:
            return sum(t.name == "shardsync-flood-conn" for t in threading.enumerate())

        assert _wait_for(lambda: serving() <= srv.admission.max_per_source + 4), serving()
        t0 = time.monotonic()
        c = ControlClient(srv.address, TOKEN, peer="flooded server")  # the flood is still connected
        assert isinstance(c.call(m.Renew(), timeout_s=5), m.Ack) and time.monotonic() - t0 < 2
        c.close()
    finally:
        for s in flood:
            s.close()
        srv.close()


def test_a_dripped_handshake_is_cut_at_one_deadline() -> None:
    srv = ControlServer("127.0.0.1", 0, TOKEN, _ack, auth_timeout_s=1.0, name="drip")
    try:
        s = socket.create_connection(tuple(srv.address), timeout=5)
        t0, cut = time.monotonic(), None
        assert s.recv(19)[:3] == b"SS2"  # the server's challenge
        drip = b"a" * 48  # the 48-byte answer, sent one byte every 0.25 s
        for i in range(40):  # under any per-recv timeout; never a whole token within the deadline
            try:
                s.sendall(drip[i:i + 1])
                s.settimeout(0.25)
                if s.recv(1) == b"":
                    cut = time.monotonic() - t0
                    break
            except socket.timeout:
                continue
            except OSError:
                cut = time.monotonic() - t0
                break
        s.close()
        assert cut is not None and cut < 2.5, cut
        assert srv.admission.refused["deadline"] == 1, dict(srv.admission.refused)
    finally:
        srv.close()


# ------------------------------------------------------------------------------------------- token holders
@pytest.fixture(scope="module")
def pair():
    """Producers 0 and 1 (both hold everything) and one zoo consumer, synced once."""
    kw = dict(n_producers=2, n_consumers=1, token=TOKEN, max_chunk_bytes=32 << 10, lease_s=2.0, timeout_s=10.0,
              init_timeout_s=30.0)
    p0 = Producer(_Source(hf_state_dict(CFG, seed=0)), ProducerConfig(rank=0, **kw))
    p1 = Producer(_Source(hf_state_dict(CFG, seed=0)), ProducerConfig(rank=1, coordinator=p0.address, **kw))
    err0: list = []
    err1: list = []
    th0 = threading.Thread(target=lambda: _catch(p0.init, err0), daemon=True)
    th1 = threading.Thread(target=lambda: _catch(p1.init, err1), daemon=True)
    th0.start(), th1.start()
    z = _Zoo(p0.address, "r0/tp0")
    _start([z])
    th0.join(30), th1.join(30)
    assert not err0 and not err1, (err0, err1)
    _sync2(p0, p1, [z], 1)
    yield p0, p1, z
    z.c.close()
    p1.close()
    p0.close()


def _sync2(p0: Producer, p1: Producer, zoos: list, v: int, may_drop: frozenset[str] = frozenset()) -> dict:
    """Version ``v`` from both producers: every zoo consumer completes it exact; only ``may_drop`` (an attacker's
    connection that sends no heartbeat) may be dropped from it."""
    p1.source.at(v)
    errs: list = []
    th = threading.Thread(target=lambda: _catch(lambda: p1.sync(v), errs), daemon=True)
    th.start()
    stats, errs0 = _sync(p0, zoos, v)
    th.join(30)
    assert not errs and not errs0, (errs, errs0)
    assert set(stats["dropped"]) <= may_drop and all(z.exact(v) for z in zoos), stats
    return stats


def test_huge_reasons_are_clipped_where_received_and_heartbeat_replies_stay_small(pair) -> None:
    p0, p1, z = pair
    c = ControlClient(p0.address, TOKEN, peer="coordinator")
    w = c.call(m.Hello(consumer="holder"), timeout_s=10)  # a token holder with a session of its own
    for v in (2, 3, 4):
        c.call(m.Abandon(consumer="holder", session=w.session, version=v, reason="x" * (90 << 20)), timeout_s=30)
    stored = [why for (_, cid, _), why in p0.coordinator.ms.left.items() if cid == "holder"]
    assert len(stored) == 3 and all(len(why) <= m.MAX_REASON for why in stored), [len(s) for s in stored]
    with pytest.raises(SyncError, match="only versions"):  # a version far ahead is not kept at all
        c.call(m.Abandon(consumer="holder", session=w.session, version=10 ** 9, reason="later"), timeout_s=10)
    lease = c.call(m.Renew(consumer="holder", session=w.session), timeout_s=10)
    assert len(m.encode(lease)) < 64 << 10, len(m.encode(lease))
    c.call(m.Goodbye(consumer="holder", session=w.session), timeout_s=10)
    c.close()
    _sync2(p0, p1, [z], 2)  # the group is unharmed


def test_a_forged_abandon_to_a_later_producer_drops_nobody(pair) -> None:
    p0, p1, z = pair
    c = ControlClient(p1.address, TOKEN, peer="producer 1")
    nxt = max(p1.versions) + 1
    c.call(m.Abandon(consumer="r0/tp0", session="f" * 32, version=nxt, reason="forged"), timeout_s=10)
    with pytest.raises(SyncError, match="can be abandoned before they begin"):
        c.call(m.Abandon(consumer="r0/tp0", session="f" * 32, version=nxt + 100, reason="x" * (1 << 20)),
               timeout_s=10)
    assert sum(map(len, p1.abandoned.values())) == 1  # only the one for the next version is held
    c.close()
    _sync2(p0, p1, [z], nxt)  # the consumer was not dropped (its real session differs): exact
    assert not p1.abandoned  # consumed at the version's begin


def test_a_hello_cannot_take_over_a_live_consumer(pair) -> None:
    from shardsync.errors import SessionInUse

    p0, p1, z = pair
    c = ControlClient(p0.address, TOKEN, peer="coordinator")
    for _ in range(3):  # said before each version, it would keep the victim out of every one
        with pytest.raises(SessionInUse, match="'r0/tp0' belongs to a live session"):
            c.call(m.Hello(consumer="r0/tp0"), timeout_s=10)
        with pytest.raises(SessionInUse):
            c.call(m.Hello(consumer="r0/tp0", session="0" * 32), timeout_s=10)  # a wrong proof is no proof
    c.close()
    _sync2(p0, p1, [z], max(p1.versions) + 1)  # still a member, still exact


def test_plans_of_consumers_that_left_are_pruned_and_all_plans_together_have_a_budget(pair) -> None:
    p0, p1, z = pair
    co = p0.coordinator
    base_keys, base_plans, budget, bound = set(co.routes), set(co.plans), co.max_routed_bytes, co.max_group_bytes
    co.max_group_bytes = 1 << 40  # the one-group bound apart (test_hardening_budgets.py): the routed budget here
    c = ControlClient(p0.address, TOKEN, peer="coordinator")
    one = forged_plan([x.to_dict() for x in co.metadata], "evil0", "amplify")
    per_plan = sum(s.nbytes for g in one.groups for s in g.scatters)
    co.max_routed_bytes = sum(sum(s.nbytes for g in co.plans[d].groups for s in g.scatters) for d in co.plans) \
        + 3 * per_plan  # room for three amplifying plans
    sessions = {}
    try:
        for i in range(6):
            cid = f"evil{i}"
            w = c.call(m.Hello(consumer=cid), timeout_s=10)
            sessions[cid] = w.session
            plan = forged_plan(w.metadata, cid, "amplify", times=60 - i)  # six distinct plans (distinct digests)
            if i < 3:
                c.call(m.RegisterPlan(consumer=cid, session=w.session, plan=plan.to_json()), timeout_s=10)
            else:
                with pytest.raises(PlanError, match=f"consumer '{cid}'.*over the budget"):
                    c.call(m.RegisterPlan(consumer=cid, session=w.session, plan=plan.to_json()), timeout_s=10)
        assert len(co.routes) == len(base_keys) + 3
        for cid, s in sessions.items():
            c.call(m.Goodbye(consumer=cid, session=s), timeout_s=10)
    finally:
        co.max_routed_bytes, co.max_group_bytes = budget, bound
        c.close()
    _sync2(p0, p1, [z], max(p1.versions) + 1)  # the next version prunes them: nothing packed for the departed
    assert set(co.routes) == base_keys and set(co.plans) == base_plans, (set(co.routes), base_keys)


def test_the_token_never_shows_in_a_repr() -> None:
    from shardsync.integrations.vllm.worker_backend import ShardsyncInitInfo
    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo

    secret = "s3cr3t-" + os.urandom(8).hex()
    for obj in (ProducerConfig(rank=0, n_producers=1, n_consumers=1, token=secret),
                ShardsyncTrainerInitInfo(rank=0, token=secret),
                ShardsyncInitInfo(coordinator=["127.0.0.1", 1], token=secret)):
        assert secret not in repr(obj) and secret not in str(obj), type(obj).__name__


def test_a_producer_dripping_data_fails_the_read_at_its_deadline() -> None:
    """A producer that answers a read one byte at a time (each under any per-recv timeout) fails it typed at the
    read's total deadline, not after the whole payload trickled in."""
    import torch

    from shardsync.errors import TransportError
    from shardsync.security.handshake import server_auth
    from shardsync.transport.tcp import TcpTransport, recv_exact

    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        conn, _ = srv.accept()
        with conn:
            assert server_auth(conn, TOKEN, deadline_s=5)  # a producer that holds the token
            recv_exact(conn, 16)  # the read request
            conn.sendall(b"K")
            while not stop.is_set():
                try:
                    conn.sendall(b"\x01")
                except OSError:
                    return
                time.sleep(0.2)

    th = threading.Thread(target=drip, daemon=True)
    th.start()
    cons = TcpTransport(token=TOKEN)
    cons.connect(0, {"host": "127.0.0.1", "port": srv.getsockname()[1], "nbytes": 1 << 20})
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="did not complete within 1.0 s"):
        cons.read(0, 0, 4096, torch.empty(4096, dtype=torch.uint8), timeout_s=1.0)
    assert time.monotonic() - t0 < 2.0
    stop.set()
    cons.close()
    srv.close()


def test_the_handshake_never_sends_the_token_and_an_answer_cannot_be_replayed() -> None:
    """Challenge-response both ways (``security/handshake.py``): what crosses the wire holds no token, a recorded
    answer does not open a second connection, and a listener without the token cannot pose as a server."""
    from shardsync.errors import AuthError
    from shardsync.security.handshake import client_auth, server_auth

    def through(server_token: str):
        """A client's handshake with a server holding ``server_token``; every byte the client sent, and the result."""
        a, b = socket.socketpair()
        out: dict = {}
        th = threading.Thread(target=lambda: out.update(ok=server_auth(b, server_token, deadline_s=5) is not None))
        th.start()
        try:
            client_auth(a, TOKEN, peer="producer 0")
            out["client"] = "ok"
        except AuthError as e:
            out["client"] = str(e)
        th.join(10)
        a.close()
        b.close()
        return out

    assert through(TOKEN) == {"ok": True, "client": "ok"}
    assert through("another group's token")["client"] == "producer 0 refused this connection's token"

    from shardsync.transport.tcp import recv_exact

    sent = bytearray()  # a sniffer relaying a successful handshake: client <-> (a, r1) relay (r2, b) <-> server
    a, r1 = socket.socketpair()
    r2, b = socket.socketpair()
    th = threading.Thread(target=lambda: server_auth(b, TOKEN, deadline_s=5))
    th.start()

    def relay() -> None:
        r1.sendall(recv_exact(r2, 19))
        sent.extend(recv_exact(r1, 48))
        r2.sendall(bytes(sent))
        r1.sendall(recv_exact(r2, 33))
    rl = threading.Thread(target=relay)
    rl.start()
    client_auth(a, TOKEN, peer="producer 0")
    th.join(10)
    rl.join(10)
    for s in (a, r1, r2, b):
        s.close()
    assert len(sent) == 48 and TOKEN.encode() not in bytes(sent)

    a, b = socket.socketpair()  # the recorded answer, replayed against a fresh challenge
    res: dict = {}
    th = threading.Thread(target=lambda: res.update(ok=server_auth(b, TOKEN, deadline_s=5) is not None))
    th.start()
    a.recv(19)
    a.sendall(bytes(sent))
    assert a.recv(1) == b"E"
    th.join(10)
    assert res == {"ok": False}
    a.close()
    b.close()

    a, b = socket.socketpair()  # a listener that speaks the protocol but holds no token: the client refuses it
    def impostor() -> None:
        b.sendall(b"SS2" + b"\0" * 16)
        b.recv(48)
        b.sendall(b"K" + b"\0" * 32)
    th = threading.Thread(target=impostor)
    th.start()
    with pytest.raises(AuthError, match="without holding the group's token"):
        client_auth(a, TOKEN, peer="producer 0")
    th.join(10)
    a.close()
    b.close()
