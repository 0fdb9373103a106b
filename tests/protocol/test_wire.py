"""The hardened wire and prompt failures, with a real producer and consumers (threads of this process).

Wire: wrong or oversized tokens, oversized frames, forged plans, a release for another consumer and a
corrupted chunk are each refused with a typed error, before anything is allocated. Failures reach the
side that waits at once, naming the consumer and the reason: a rejected version, a consumer that
fails to start, a consumer that never comes; ``close()`` right after ``sync()`` loses no reply.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc
from typing import Any

import pytest
import torch

from shardsync.engine.protocol import messages as m
from shardsync.engine.consumer.consumer import Consumer
from shardsync.engine.protocol.control import ControlClient
from shardsync.engine.producer.producer import Producer, ProducerConfig
from shardsync.engine.protocol.wire import handshake_client
from shardsync.errors import AuthError, ChecksumError, PlanError, ShardsyncError, SyncError, TransportError
from shardsync.source import ModuleSource
from shardsync.testing.harness.attacks import FORGES, forged_plan
from shardsync.testing.harness.consumers import ZooConsumer
from shardsync.transport.tcp import TcpTransport
from shardsync.testing.zoo import ZooConfig, hf_state_dict

CFG = ZooConfig.qwen3_moe_tiny(layers=2)
TOKEN = "t0ken"


class _Source(ModuleSource):
    def at(self, v: int) -> None:
        self._state = dict(hf_state_dict(CFG, seed=v))


def _producer(n_consumers: int, **kw: Any) -> tuple[Producer, threading.Thread, list]:
    kw = {"lease_s": 2.0, "timeout_s": 10.0, "init_timeout_s": 30.0, **kw}
    p = Producer(_Source(hf_state_dict(CFG, seed=0)), ProducerConfig(rank=0, n_producers=1, n_consumers=n_consumers,
                                                                      token=TOKEN, max_chunk_bytes=32 << 10, **kw))
    err: list = []
    th = threading.Thread(target=lambda: _catch(p.init, err), daemon=True)
    th.start()
    return p, th, err


def _catch(fn, err: list) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test
        err.append(e)


class _Zoo(ZooConsumer):
    """One zoo consumer (its live model) and a Consumer that writes into it."""

    def __init__(self, addr: list, cid: str, tp: int = 1, rank: int = 0, record=None, **kw: Any):
        super().__init__(CFG, cid, tp=tp, tp_rank=rank)
        self.c = Consumer(cid, addr, token=TOKEN, record=record or self.record, apply=self.apply, timeout_s=10.0, **kw)

    def exact(self, v: int) -> bool:
        return not self.mismatched(hf_state_dict(CFG, seed=v))


def _start(zoos: list[_Zoo]) -> list:
    err: list = []
    ths = [threading.Thread(target=_catch, args=(z.c.init, err), daemon=True) for z in zoos]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not err, err
    return err


def _sync(p: Producer, zoos: list[_Zoo], v: int) -> tuple[dict, list]:
    p.source.at(v)
    errs: list = []
    ths = [threading.Thread(target=_catch, args=(lambda z=z: z.c.sync(v), errs), daemon=True) for z in zoos]
    for t in ths:
        t.start()
    stats = p.sync(v)
    for t in ths:
        t.join(30)
    return stats, errs


def _close(p: Producer, zoos: list[_Zoo]) -> None:
    for z in zoos:
        z.c.close()
    p.close()


@pytest.fixture(scope="module")
def group():
    p, th, err = _producer(2)
    zoos = [_Zoo(p.address, "r0/tp0"), _Zoo(p.address, "r1/tp0")]
    _start(zoos)
    th.join(30)
    assert not err, err
    stats, errs = _sync(p, zoos, 1)
    assert not errs and all(z.exact(1) for z in zoos), errs
    yield p, zoos
    _close(p, zoos)


def test_wrong_and_oversized_tokens_are_refused_before_any_frame(group) -> None:
    p, _ = group
    before = p.server.refused["token"]
    with pytest.raises(AuthError, match="refused"):
        ControlClient(p.address, TOKEN + "x", peer="coordinator")
    with pytest.raises(AuthError, match="at most 256"):
        ControlClient(p.address, "x" * 300, peer="coordinator")
    with socket.create_connection(tuple(p.address), timeout=5) as s:  # a raw peer that sends its token in the clear
        hello = s.recv(19)
        assert hello[:3] == b"SS2" and len(hello) == 19  # a challenge: the server never asks for the token itself
        s.sendall(TOKEN.encode().ljust(48, b"\0")[:48])
        assert s.recv(1) == b"E"
    deadline = time.monotonic() + 2  # counted by the serving thread right after it answered
    while p.server.refused["token"] < before + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.server.refused["token"] == before + 2


def test_oversized_frame_is_refused_before_allocation(group) -> None:
    p, _ = group
    before = p.server.refused["frame"]
    tracemalloc.start()
    try:
        with socket.create_connection(tuple(p.address), timeout=5) as s:
            handshake_client(s, TOKEN, "coordinator")
            t0 = time.monotonic()
            s.sendall(struct.pack("!I", 0xFFFFFFF0))  # ~4 GiB announced, never sent
            assert s.recv(1) == b""  # closed at once: the server did not wait for (or allocate) the payload
            assert time.monotonic() - t0 < 2
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert p.server.refused["frame"] == before + 1
    assert peak < 16 << 20, peak


@pytest.mark.parametrize("forge", FORGES)
def test_forged_plan_is_refused_naming_the_consumer(group, forge: str) -> None:
    p, _ = group
    plans_before = set(p.coordinator.plans)
    c = ControlClient(p.address, TOKEN, peer="coordinator")
    w = c.call(m.Hello(consumer=f"evil-{forge}"), timeout_s=10)
    plan = forged_plan(w.metadata, f"evil-{forge}", forge)
    with pytest.raises(PlanError, match=f"consumer 'evil-{forge}'"):
        c.call(m.RegisterPlan(consumer=f"evil-{forge}", session=w.session, plan=plan.to_json()), timeout_s=10)
    c.call(m.Goodbye(consumer=f"evil-{forge}", session=w.session), timeout_s=10)
    c.close()
    assert set(p.coordinator.plans) == plans_before  # nothing kept, nothing routed, nothing allocated


def test_release_for_another_consumer_is_refused(group) -> None:
    p, (a, b) = group
    c = ControlClient(p.address, TOKEN, peer="producer 0")
    with pytest.raises(AuthError, match="does not belong to consumer 'r0/tp0'"):
        c.call(m.Released(consumer="r0/tp0", session=b.c.session, version=1, group="pre"), timeout_s=10)
    with pytest.raises(AuthError, match="does not belong to consumer 'r0/tp0'"):
        c.call(m.Goodbye(consumer="r0/tp0", session=b.c.session), timeout_s=10)
    c.close()
    stats, errs = _sync(p, [a, b], 2)  # and both are still members
    assert not errs and not stats["dropped"] and a.exact(2) and b.exact(2)


def test_tcp_data_plane_checks_the_token() -> None:
    prod, cons = TcpTransport(token="right"), TcpTransport(token="wrong")
    desc = prod.register(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(TransportError, match="rejected the token"):
        cons.connect(0, desc)
    prod.close()
    cons.close()


def test_rejected_version_reaches_the_producer_at_once() -> None:
    p, th, err = _producer(2)
    a, b = _Zoo(p.address, "r0/tp0"), _Zoo(p.address, "r1/tp0")
    _start([a, b])
    th.join(20)
    t0 = time.monotonic()
    stats, errs = _sync(p, [a, b], 0)  # a loop starting at version 0: every engine holds 0 already
    assert time.monotonic() - t0 < 5  # not the 10 s sync timeout: the rejections reached the producer at once
    assert len(errs) == 2 and all(isinstance(e, SyncError) and "not newer" in str(e) for e in errs), errs
    assert set(stats["dropped"]) == {"r0/tp0", "r1/tp0"} and "not newer" in stats["dropped"]["r0/tp0"], stats
    stats, errs = _sync(p, [a, b], 1)
    assert not errs and a.exact(1) and b.exact(1)
    _close(p, [a, b])


def test_corrupted_chunk_is_a_typed_error_naming_group_chunk_and_producer() -> None:
    p, th, err = _producer(1, verify_checksums=True)
    z = _Zoo(p.address, "r0/tp0", verify_checksums=True)
    _start([z])
    th.join(30)
    read = z.c.transport.read

    def flip(prod, off, n, into, **kw):
        read(prod, off, n, into, **kw)
        into[n // 2] ^= 1  # one bit, in transit

    z.c.transport.read = flip  # type: ignore[method-assign]
    try:
        stats, errs = _sync(p, [z], 1)
        assert len(errs) == 1 and isinstance(errs[0], ChecksumError), errs
        assert "chunk 0 of group 'pre' from producer 0" in str(errs[0])
        assert "r0/tp0" in stats["dropped"] and "ChecksumError" in stats["dropped"]["r0/tp0"]
        z.c.transport.read = read  # type: ignore[method-assign]
        stats, errs = _sync(p, [z], 2)
        assert not errs and z.exact(2)
    finally:
        _close(p, [z])


def test_a_consumer_that_fails_to_start_fails_init_promptly() -> None:
    """Once the join grace has passed, nobody is recording and registered plus failed consumers fill every slot,
    init fails naming the failure (a junk Hello cannot do this before the grace: ``test_hardening_members.py``)."""
    p, th, err = _producer(2, join_grace_s=1.0)

    def refuse(metas):
        raise PlanError("vLLM refused the model (test)")

    good, bad = _Zoo(p.address, "r0/tp0"), _Zoo(p.address, "r1/tp0", record=refuse)
    t0 = time.monotonic()
    errs: list = []
    ths = [threading.Thread(target=_catch, args=(z.c.init, errs), daemon=True) for z in (good, bad)]
    for t in ths:
        t.start()
    th.join(20)
    assert time.monotonic() - t0 < 10  # not init_timeout_s (30 s)
    assert err and "r1/tp0" in str(err[0]) and "vLLM refused the model" in str(err[0]), err
    for t in ths:
        t.join(20)
    p.close()


def test_init_waits_say_who_is_missing() -> None:
    p, th, err = _producer(3, init_timeout_s=3.0)
    z = _Zoo(p.address, "r0/tp0")
    errs: list = []
    t = threading.Thread(target=_catch, args=(z.c.init, errs), daemon=True)
    t.start()
    th.join(20)
    t.join(20)
    assert err and isinstance(err[0], TransportError), err
    assert "registered ['r0/tp0']" in str(err[0]) and "not heard from: 2" in str(err[0]), err[0]
    p.close()


def test_quorum_init_then_a_late_joiner_with_a_new_plan_is_routed_and_exact() -> None:
    p, th, err = _producer(2, min_consumers=1, join_grace_s=1.0)
    first = _Zoo(p.address, "r0/tp0", tp=2, rank=0)
    _start([first])
    th.join(20)
    assert not err, err
    _, errs = _sync(p, [first], 1)
    assert not errs and first.exact(1)
    late = _Zoo(p.address, "r0/tp1", tp=2, rank=1)  # another TP rank: a plan digest routed after init
    _start([late])
    assert late.c.plan.digest != first.c.plan.digest
    stats, errs = _sync(p, [first, late], 2)
    assert not errs and first.exact(2) and late.exact(2), errs
    assert stats["members"] == ["r0/tp0", "r0/tp1"]
    _close(p, [first, late])


def test_close_right_after_sync_loses_no_reply_and_leaves_no_thread() -> None:
    before = {t.name for t in threading.enumerate()}
    p, th, err = _producer(1)
    z = _Zoo(p.address, "r0/tp0")
    _start([z])
    th.join(20)
    p.source.at(1)
    errs: list = []
    t = threading.Thread(target=_catch, args=(lambda: z.c.sync(1), errs), daemon=True)
    t.start()
    p.sync(1)
    p.close()  # at once: the consumer's last Released must still be answered
    t.join(20)
    assert not errs and z.exact(1), errs
    z.c.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t.name for t in threading.enumerate() if t.name.startswith("shardsync") and t.name not in before]
        if not left:
            break
        time.sleep(0.1)
    assert not left, left


def test_errors_travel_typed() -> None:
    assert issubclass(ChecksumError, ShardsyncError) and issubclass(AuthError, TransportError)


def test_bind_all_interfaces_advertises_the_given_address_and_data_plane_uses_the_token() -> None:
    p, th, err = _producer(1, host="0.0.0.0", advertise_host="127.0.0.1")
    assert p.address[0] == "127.0.0.1"
    z = _Zoo(p.address, "r0/tp0")
    _start([z])
    th.join(20)
    assert p.desc["host"] == "127.0.0.1"
    intruder = TcpTransport(token="")  # the ring's bytes are not served without the group's token
    with pytest.raises(TransportError, match="rejected the token"):
        intruder.connect(0, p.desc)
    intruder.close()
    _, errs = _sync(p, [z], 1)
    assert not errs and z.exact(1)
    _close(p, [z])


def test_addresses_accept_host_port_strings_and_refuse_bad_ones_clearly() -> None:
    from shardsync.engine.protocol.wire import parse_address
    from shardsync.transport.tcp import advertised

    assert parse_address("10.0.0.7:29600") == ["10.0.0.7", 29600]
    assert parse_address("[::1]:80") == ["::1", 80] and parse_address(("h", "5")) == ["h", 5]
    for bad in ("10.0.0.7", "h:port", ":5", ["h"], 29600, None):
        with pytest.raises(ValueError, match="address"):
            parse_address(bad)
    assert advertised("0.0.0.0", "trainer-3") == "trainer-3"
    assert advertised("10.1.2.3", None) == "10.1.2.3"
    assert advertised("0.0.0.0", None) not in ("0.0.0.0", "")  # a wildcard bind never hands out 0.0.0.0
