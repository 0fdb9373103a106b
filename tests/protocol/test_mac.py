"""Keyed MACs for untrusted networks (``ProducerConfig.mac``): chunk tags and per-frame MACs on control connections.

Pure: a chunk tag binds producer, version, group, chunk and length, and a bad one names all of them but never the
token or key; frame MACs refuse replay, reordering, reflection and injection; the handshake negotiates them (a client
requiring them refuses a plain server; rewriting the hello fails the handshake). Real processes (a ``LocalCluster``
with mac on): syncs are exact; a flipped chunk bit and chunks replayed with their tags from another version, group
or producer are ``ChunkMacError`` and the next sync is exact again; a byte flipped in a control frame by a
man-in-the-middle proxy closes that connection (counted by the server) while the consumers' sync completes exact; a
consumer requiring MACs refuses a plain group within seconds, naming what to change.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgspec
import pytest
import torch

from shardsync.engine.protocol import messages as m
from shardsync.security.chunkmac import check_chunk, chunk_key, chunk_tag
from shardsync.engine.consumer.consumer import Consumer
from shardsync.engine.protocol.control import ControlClient
from shardsync.engine.protocol.wire import recv_frame, send_frame
from shardsync.errors import AuthError, ChunkMacError, FrameMacError, SyncError, TransportError
from shardsync.security.framemac import FrameMac
from shardsync.security.handshake import client_auth, server_auth
from shardsync.testing.harness.cluster import LocalCluster
from shardsync.testing.harness.consumers import ZooConsumer
from shardsync.testing.harness.tamper import FIRST_FRAME_C2S, FIRST_FRAME_S2C, MitmProxy
from shardsync.testing.zoo import ZooConfig

TOKEN = "m4c-t0ken-of-the-group"


# ---------------------------------------------------------------- pure
def test_chunk_tags_bind_producer_version_group_chunk_and_length() -> None:
    key, data = chunk_key(TOKEN), torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    assert len(key) == 32 and key != chunk_key(TOKEN + "x") and TOKEN.encode() not in key
    at = dict(producer=1, version=7, group="model.layers.3", chunk=2)
    tag = chunk_tag(key, data=data, **at)
    assert len(tag) == 16 and tag == chunk_tag(key, data=data.clone(), **at)
    check_chunk(key, tag, consumer="r0/tp0", data=data, **at)
    flipped = data.clone()
    flipped[100] ^= 1
    others = [dict(at, producer=0), dict(at, version=6), dict(at, group="model.layers.4"), dict(at, chunk=3)]
    for where, d in [*[(o, data) for o in others], (at, flipped), (at, data[:-1])]:
        with pytest.raises(ChunkMacError) as e:
            check_chunk(key, tag, consumer="r0/tp0", data=d, **where)
        msg = str(e.value)
        for part in ("consumer r0/tp0", f"producer {where['producer']}", f"chunk {where['chunk']}",
                     repr(where["group"]), f"version {where['version']}"):
            assert part in msg, (part, msg)
        assert TOKEN not in msg and key.hex() not in msg and tag.hex() not in msg
    assert chunk_tag(chunk_key("another group"), data=data, **at) != tag


def test_frame_macs_refuse_replay_reorder_reflection_and_injection() -> None:
    ns, nc = b"s" * 16, b"c" * 16
    cli, srv = FrameMac(TOKEN, ns, nc, server=False), FrameMac(TOKEN, ns, nc, server=True)
    for i in range(3):  # both ways, in order
        p = f"request {i}".encode()
        srv.check(p, cli.seal(p))
        q = f"reply {i}".encode()
        cli.check(q, srv.seal(q))
    p = b"request 3"
    t3 = cli.seal(p)
    srv.check(p, t3)
    with pytest.raises(FrameMacError, match="replayed"):
        srv.check(p, t3)  # the same frame again
    a, b = cli.seal(b"a"), cli.seal(b"b")
    with pytest.raises(FrameMacError):
        srv.check(b"b", b)  # reordered
    srv2, cli2 = FrameMac(TOKEN, ns, nc, server=True), FrameMac(TOKEN, ns, nc, server=False)
    with pytest.raises(FrameMacError):
        cli2.check(b"x", cli2.seal(b"x"))  # a client's own frame reflected back to it
    with pytest.raises(FrameMacError):
        srv2.check(b"x", FrameMac(TOKEN, ns, b"C" * 16, server=False).seal(b"x"))  # another connection's key
    with pytest.raises(FrameMacError):
        srv2.check(b"x", FrameMac("not the token", ns, nc, server=False).seal(b"x"))  # injected without the token
    srv3 = FrameMac(TOKEN, ns, nc, server=True)
    with pytest.raises(FrameMacError):
        srv3.check(b"y", FrameMac(TOKEN, ns, nc, server=False).seal(b"x"))  # payload changed
    assert "key" not in repr(srv3) and TOKEN not in repr(srv3)


def _pair(server_kw: dict, client_kw: dict, relay=None) -> tuple[dict, dict]:
    """A handshake over a socketpair (through ``relay(client_side, server_side)`` when given)."""
    if relay is None:
        a, b = socket.socketpair()
        ends = [a, b]
    else:
        a, r1 = socket.socketpair()
        r2, b = socket.socketpair()
        ends = [a, r1, r2, b]
        threading.Thread(target=relay, args=(r1, r2), daemon=True).start()
    srv: dict = {}

    def serve() -> None:
        try:
            srv["auth"] = server_auth(b, TOKEN, deadline_s=5, **server_kw)
        except ConnectionError:
            srv["left"] = True  # the client gave up first

    th = threading.Thread(target=serve)
    th.start()
    cli: dict = {}
    try:
        cli["auth"] = client_auth(a, TOKEN, peer="producer 0", timeout_s=5, **client_kw)
    except AuthError as e:
        cli["error"] = str(e)
    a.close()  # a client that gave up: the server's read ends now
    th.join(10)
    for s in ends:
        s.close()
    return srv, cli


def test_the_handshake_negotiates_frame_macs_and_a_rewritten_hello_fails() -> None:
    a, b = socket.socketpair()
    srv: dict = {}
    th = threading.Thread(target=lambda: srv.update(auth=server_auth(b, TOKEN, deadline_s=5, mac=True)))
    th.start()
    cli = client_auth(a, TOKEN, peer="producer 0")  # a client that does not require MACs follows the server
    th.join(10)
    assert cli.frames is not None and srv["auth"].frames is not None
    send_frame(a, b"hello", cli.frames)
    assert recv_frame(b, max_frame_bytes=64, mac=srv["auth"].frames) == b"hello"
    send_frame(b, b"world", srv["auth"].frames)
    assert recv_frame(a, max_frame_bytes=64, mac=cli.frames) == b"world"
    a.sendall(struct.pack("!I", 8) + b"injected" + bytes(16))  # a frame injected without the key is refused
    with pytest.raises(FrameMacError):
        recv_frame(b, max_frame_bytes=64, mac=srv["auth"].frames)
    a.close()
    b.close()

    srv, cli = _pair({}, {"require_mac": True})  # a plain server, a client that requires MACs: refused at once
    assert "does not MAC its control frames" in cli["error"] and "mac=True" in cli["error"] and srv == {"left": True}
    srv, cli = _pair({}, {})
    assert srv["auth"] is not None and srv["auth"].frames is None and cli["auth"].frames is None

    def rewrite(old: bytes, new: bytes):
        def relay(r1: socket.socket, r2: socket.socket) -> None:  # client side r1, server side r2
            try:
                hello = r2.recv(19)
                r1.sendall(hello.replace(old, new))
                r2.sendall(r1.recv(48))
                r1.sendall(r2.recv(33))
            except OSError:
                pass
        return relay

    from shardsync.security import handshake

    seen = handshake.DOWNGRADES[0]
    srv, cli = _pair({"mac": True}, {}, rewrite(b"SM2", b"SS2"))  # a downgrade: the server refuses the proof
    assert srv["auth"] is None and "refused" in cli["error"]
    assert handshake.DOWNGRADES[0] == seen + 1  # named as a rewritten negotiation, not counted as a wrong token
    srv, cli = _pair({}, {}, rewrite(b"SS2", b"SM2"))  # an upgrade of a plain server fails the same way
    assert srv["auth"] is None and "refused" in cli["error"]


def test_ready_tags_are_bounded_where_received() -> None:
    ok = m.Ready(version=1, group="g", chunks=[[0, 0, 8, -1]], tags=[b"t" * 16])
    assert m.decode(m.encode(ok)) == ok
    for bad in (b"t" * 17, b"t" * 15, b"t" * (1 << 20)):
        with pytest.raises(msgspec.ValidationError):
            m.decode(m.encode(m.Ready(version=1, group="g", chunks=[[0, 0, 8, -1]], tags=[bad])))


def test_a_wrong_frame_tag_closes_the_connection_and_is_counted() -> None:
    from shardsync.engine.protocol.control import ControlServer

    server = ControlServer("127.0.0.1", 0, TOKEN, lambda msg: m.Ack(), mac=True, name="t")
    try:
        assert isinstance(ControlClient(server.address, TOKEN, peer="s", require_mac=True).call(m.Lookup(),
                                                                                                 timeout_s=5), m.Ack)
        with MitmProxy(server.address, flip_at=FIRST_FRAME_C2S + 5) as px:  # the request's payload
            c = ControlClient(px.address, TOKEN, peer="s")
            with pytest.raises(TransportError):
                c.call(m.Lookup(), timeout_s=5)
            assert px.flipped == 1 and server.refused["mac"] == 1 and server.admission.refused["mac"] == 1
        direct = ControlClient(server.address, TOKEN, peer="s")  # the server serves on: a fresh, untouched connection
        assert isinstance(direct.call(m.Lookup(), timeout_s=5), m.Ack) and direct.macs
        with MitmProxy(server.address, flip_at=FIRST_FRAME_S2C + 5, direction="s2c") as px:  # the reply's payload
            c = ControlClient(px.address, TOKEN, peer="s")
            with pytest.raises(FrameMacError, match="connection closed"):
                c.call(m.Lookup(), timeout_s=5)
            assert c._sock is None
    finally:
        server.close()


def test_every_rank_of_a_group_must_agree_on_mac() -> None:
    from test_wire import CFG, _Source
    from shardsync.engine.producer.producer import Producer, ProducerConfig
    from shardsync.testing.zoo import hf_state_dict

    kw = dict(n_producers=2, n_consumers=1, token=TOKEN, lease_s=2.0, timeout_s=5.0, init_timeout_s=10.0)
    p0 = Producer(_Source(hf_state_dict(CFG, seed=0)), ProducerConfig(rank=0, mac=True, **kw))
    p1 = Producer(_Source(hf_state_dict(CFG, seed=0)), ProducerConfig(rank=1, mac=False, coordinator=p0.address, **kw))
    try:
        t0 = time.monotonic()
        with pytest.raises(SyncError, match=r"producer 1 runs with mac=False, producer 0 with mac=True"):
            p1.init()
        assert time.monotonic() - t0 < 5
    finally:
        p1.close()
        p0.close()


# ---------------------------------------------------------------- real processes
CFG = ZooConfig.qwen3_moe_tiny(layers=4)  # two like layers per producer: a chunk of one fits the other
CID = "r0/tp0"


class _Versions:
    def __init__(self) -> None:
        self.v = 0

    def next(self) -> int:
        self.v += 1
        return self.v


@pytest.fixture(scope="module")
def mac_cluster():
    """Two producer processes (PP halves, mac on) and one consumer process requiring MACs."""
    with LocalCluster(CFG, producers=2, replicas=1, tp=1, mac=True, lease_s=2.0, timeout_s=16.0,
                      max_chunk_bytes=32 << 10) as cl:
        yield cl, _Versions()


def _refused_chunk(r: dict, v: int) -> str:
    """The consumer's typed error for a tampered chunk in sync ``v`` (the producers dropped it, nothing else)."""
    (c,) = r["consumers"]
    assert c["kind"] == "ChunkMacError" and not c["exact"], c
    assert f"consumer {CID}: chunk " in c["error"] and f"(version {v}) failed its MAC" in c["error"], c["error"]
    assert set(r["failed"]) == {CID}, r["failed"]
    return c["error"]


@pytest.mark.procs
def test_with_mac_syncs_are_exact_and_a_flipped_chunk_bit_is_a_typed_error(mac_cluster) -> None:
    cl, vs = mac_cluster
    assert cl.sync(vs.next())["exact"]
    v = vs.next()
    err = _refused_chunk(cl.sync(v, faults={CID: {"flip_at_chunk": 3}}, tolerate=True), v)
    assert "from producer " in err and cl.token not in err
    assert cl.sync(vs.next())["exact"]


@pytest.mark.procs
def test_chunks_replayed_with_their_tags_from_another_version_group_or_producer_are_refused(mac_cluster) -> None:
    cl, vs = mac_cluster
    assert cl.sync(vs.next(), faults={CID: {"replay": "record"}})["exact"]  # the recording starts
    n = 0
    for kind in ("version", "group", "producer"):
        v = vs.next()
        r = cl.sync(v, faults={CID: {"replay": kind}}, tolerate=True)
        err = _refused_chunk(r, v)
        assert len(r["consumers"][0]["replayed"]) == n + 1, r["consumers"][0]
        n += 1
        p, kv, g, ci = r["consumers"][0]["replayed"][-1]  # where the replayed chunk and its tag came from
        if kind == "version":
            assert kv < v and f"chunk {ci} of group {g!r} from producer {p} (version {v})" in err, err
        elif kind == "group":
            assert f"from producer {p} (version {v})" in err and f"of group {g!r}" not in err, err
        else:
            assert f"from producer {p} " not in err, err
        assert cl.sync(vs.next())["exact"]  # the next legitimate sync heals the engine


@pytest.mark.procs
def test_a_byte_flipped_in_a_control_frame_closes_that_connection_while_the_sync_completes(mac_cluster) -> None:
    cl, vs = mac_cluster
    before = cl.hosts[0].call("refused").result(30)
    got: dict[str, list[str]] = {"c2s": [], "s2c": []}
    stop = threading.Event()

    def attack(direction: str) -> None:  # a peer holding the token, whose connection runs through a middlebox
        at = (FIRST_FRAME_C2S if direction == "c2s" else FIRST_FRAME_S2C) + 5
        with MitmProxy(cl.coordinator, flip_at=at, direction=direction) as px:
            while not stop.is_set():
                c = ControlClient(px.address, cl.token, peer="coordinator, through a MITM")
                try:
                    c.call(m.Lookup(), timeout_s=10)
                    got[direction].append("answered")
                except TransportError as e:
                    got[direction].append(type(e).__name__)
                c.close()
                time.sleep(0.05)

    ths = [threading.Thread(target=attack, args=(d,), daemon=True) for d in got]
    for t in ths:
        t.start()
    time.sleep(0.3)
    r = cl.sync(vs.next())
    stop.set()
    for t in ths:
        t.join(20)
    assert r["exact"], r
    assert got["c2s"] and set(got["c2s"]) == {"TransportError"}, got  # the server closed it
    assert got["s2c"] and set(got["s2c"]) == {"FrameMacError"}, got  # the client refused the reply
    after = cl.hosts[0].call("refused").result(30)
    assert after["mac"] - before["mac"] == len(got["c2s"]), (before, after, got)


@pytest.mark.procs
def test_a_consumer_requiring_mac_refuses_a_plain_group_within_seconds() -> None:
    with LocalCluster(CFG, producers=1, external_consumers=1, lease_s=2.0) as cl:
        zoo = ZooConsumer(CFG, CID, tp=1, tp_rank=0)
        c = Consumer(CID, cl.coordinator, token=cl.token, record=zoo.record, apply=zoo.apply, require_mac=True)
        t0 = time.monotonic()
        try:
            with pytest.raises(AuthError, match=r"does not MAC its control frames.*mac=True"):
                c.init()
            assert time.monotonic() - t0 < 5
        finally:
            c.close(goodbye=False)
            cl.kill(0)  # its init waits for a consumer that will never register
