"""Smoke test of the NIXL transport: a producer process registers a CPU buffer, this process reads it."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from shardsync.errors import TransportError

pytest.importorskip("nixl")

N = 64 << 20
pytestmark = pytest.mark.procs


def _pattern(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)


def _producer(q, stop) -> None:  # runs in a spawned process
    from shardsync.transport.nixl import NixlTransport

    t = NixlTransport(name="smoke-producer")
    buf = _pattern(N)
    q.put(t.register(buf))
    try:
        stop.get(timeout=120)  # anything on this queue means: exit
    finally:
        t.close()


@pytest.mark.timeout(120)
def test_nixl_read_ranges_and_dead_peer():
    from shardsync.transport.nixl import NixlTransport

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Queue()  # no Event: killing its waiter leaves it locked
    proc = ctx.Process(target=_producer, args=(q, stop), daemon=True)
    proc.start()
    consumer = None
    try:
        desc = q.get(timeout=60)
        assert desc["nbytes"] == N and desc["device"] == "cpu" and isinstance(desc["metadata"], str)
        consumer = NixlTransport(name="smoke-consumer")
        assert consumer.name == "nixl" and consumer.caps.one_sided
        consumer.connect(0, desc)

        ref = _pattern(N)
        out = torch.zeros(32 << 20, dtype=torch.uint8)
        for off, n in [(0, 4096), (12_345, 100_001), (N - 777, 777), (N - 1, 1), (3, 32 << 20), (0, 0)]:
            out.zero_()
            consumer.read(0, off, n, out, timeout_s=5)
            assert torch.equal(out[:n], ref[off:off + n]), (off, n)

        consumer.read(0, N - (32 << 20), 32 << 20, out, timeout_s=5)  # the last 32 MiB
        assert torch.equal(out, ref[N - (32 << 20):])

        small = torch.empty(100, dtype=torch.uint8)  # a second destination buffer
        consumer.read(0, 1000, 100, small, timeout_s=5)
        assert torch.equal(small, ref[1000:1100])

        with pytest.raises(TransportError, match="producer 0"):
            consumer.read(0, N - 10, 11, out, timeout_s=5)
        with pytest.raises(TransportError):
            consumer.read(0, -1, 10, out, timeout_s=5)
        with pytest.raises(TransportError):
            consumer.read(0, 0, 200, small, timeout_s=5)  # destination too small
        with pytest.raises(TransportError):
            consumer.read(1, 0, 10, out, timeout_s=5)  # never connected

        proc.kill()
        proc.join(10)
        t0 = time.perf_counter()
        with pytest.raises(TransportError, match=r"\[0, 33554432\) from producer 0"):
            consumer.read(0, 0, 32 << 20, out, timeout_s=5)
        assert time.perf_counter() - t0 < 15

        consumer.close()
        consumer.close()  # idempotent
        with pytest.raises(TransportError):
            consumer.read(0, 0, 10, out, timeout_s=5)
    finally:
        if consumer is not None:
            consumer.close()
        if proc.is_alive():
            stop.put(None)
            proc.join(10)
        if proc.is_alive():
            proc.kill()
        proc.join(10)
