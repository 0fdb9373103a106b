"""One contract every transport passes: exact bytes for any range, typed errors for bad ranges, and a
killed producer surfaces as TransportError within the read timeout (never a hang)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import pytest
import torch

from shardsync.errors import TransportError
from shardsync.transport import TRANSPORTS, make_transport

CTX = mp.get_context("spawn")
N = 3 * (1 << 20) + 123
RANGES = [(0, 0), (0, 64), (7, 1001), (N - 5, 5), (0, N), (1 << 20, 2 << 20)]


def pattern(n: int = N) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) * 7 % 251).to(torch.uint8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kwargs(name: str) -> dict:
    return {"tcp": {"host": "127.0.0.1", "token": "tok"}, "nccl": {"token": "tok"}, "auto": {"token": "tok"},
            "nccl:gloo": {"token": "tok", "backend": "gloo"}}.get(name, {})


def _make(name: str):
    return make_transport(name.split(":")[0], **_kwargs(name))


def _init_dist(name: str, rank: int, port: int) -> None:
    if name == "torch":
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=20))


def _producer(name: str, port: int, out, stop, device: str = "cpu") -> None:
    _init_dist(name, 0, port)
    t = _make(name)
    buf = pattern().to(device)
    out.put(t.register(buf))
    try:  # a Queue, not an Event: setting an Event a killed process waited on can deadlock
        stop.get(timeout=60)
    except Exception:
        pass


def _consumer(name: str, port: int, desc_q, out, go, device: str = "cpu") -> None:
    try:
        _init_dist(name, 1, port)
        t = _make(name)
        t.connect(0, desc_q.get(timeout=60))
        ref = pattern()
        ok = []
        for off, n in RANGES:
            into = torch.zeros(n + 3, dtype=torch.uint8, device=device)
            t.read(0, off, n, into, timeout_s=30)
            ok.append(torch.equal(into[:n].cpu(), ref[off: off + n]) and not into[n:].any())
        try:
            t.read(0, N - 10, 11, torch.zeros(11, dtype=torch.uint8, device=device), timeout_s=5)
            ok.append(False)
        except TransportError:
            ok.append(True)
        out.put(("reads", ok))
        go.wait(60)
        t0 = time.monotonic()
        try:
            t.read(0, 0, 1 << 20, torch.zeros(1 << 20, dtype=torch.uint8, device=device), timeout_s=3)
            out.put(("dead", "no error", time.monotonic() - t0))
        except TransportError as e:
            out.put(("dead", f"TransportError: {e}", time.monotonic() - t0))
        except Exception as e:  # wrong error type is a contract failure
            out.put(("dead", f"{type(e).__name__}: {e}", time.monotonic() - t0))
    except BaseException as e:
        out.put(("crash", f"{type(e).__name__}: {e}"))


@pytest.mark.procs
@pytest.mark.parametrize("name", ["tcp", "torch", "nixl", "nccl:gloo", "auto"])
def test_cross_process_contract(name: str) -> None:
    """``nccl:gloo`` is the nccl transport's protocol (request socket, one pair group per consumer, polled
    completion, abort on timeout) over gloo on CPU; the GPU run below uses NCCL itself."""
    _contract(name, "cpu", "cpu")


@pytest.mark.procs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["nccl", "nixl", "cuda_ipc", "auto"])
def test_gpu_contract(name: str) -> None:
    """VRAM to VRAM across processes: producer buffer on cuda:0, reads into cuda:1 — or into cuda:0 from another
    process when only one GPU is there (colocated); NCCL needs two (it refuses two ranks of a pair on one GPU)."""
    two = torch.cuda.device_count() >= 2
    if name == "nccl" and not two:
        pytest.skip("NCCL pairs need two GPUs (two ranks of one communicator cannot share a GPU)")
    if name == "nixl":
        pytest.importorskip("nixl", reason="NIXL is not installed on this GPU machine (the device image has none)")
    _contract(name, "cuda:0", "cuda:1" if two else "cuda:0")


def _contract(name: str, pdev: str, cdev: str) -> None:
    port = _free_port()
    desc_q, out, stop, go = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Event()
    prod = CTX.Process(target=_producer, args=(name, port, desc_q, stop, pdev), daemon=True)
    cons = CTX.Process(target=_consumer, args=(name, port, desc_q, out, go, cdev), daemon=True)
    prod.start(), cons.start()
    try:
        kind, ok = out.get(timeout=180)
        assert kind == "reads", ok
        assert all(ok), ok
        if name == "cuda_ipc" or (name == "auto" and pdev != "cpu"):  # auto: cuda_ipc within a node
            return  # a mapped allocation gives no death signal: the control plane detects a dead producer
        prod.kill()  # the producer dies: the next read must fail, typed, within its timeout
        prod.join(10)
        go.set()
        kind, err, elapsed = out.get(timeout=60)
        assert kind == "dead" and err.startswith("TransportError"), err
        assert elapsed < 3 + 10, elapsed
        assert "producer 0" in err, err
    finally:
        stop.put(None), go.set()
        for p in (prod, cons):
            p.join(5)
            if p.is_alive():
                p.kill()


def test_loopback_contract() -> None:
    prod, cons = make_transport("loopback"), make_transport("loopback")
    buf = pattern()
    cons.connect(0, prod.register(buf))
    for off, n in RANGES:
        into = torch.zeros(n, dtype=torch.uint8)
        cons.read(0, off, n, into, timeout_s=1)
        assert torch.equal(into, buf[off: off + n])
    with pytest.raises(TransportError):
        cons.read(0, N - 1, 2, torch.zeros(2, dtype=torch.uint8), timeout_s=1)
    prod.close()  # the producer goes away
    with pytest.raises(TransportError, match="producer 0"):
        cons.read(0, 0, 8, torch.zeros(8, dtype=torch.uint8), timeout_s=1)


def _retire_and_replace(name: str, device: str) -> None:
    prod, cons = _make(name), _make(name)
    try:
        a, b = pattern(4096).to(device), pattern(8192).flip(0).contiguous().to(device)
        held = pattern(1000).to(device)
        shared = prod.share(held) if prod.caps.shares_memory and (device != "cpu" or name != "auto") else None
        first = prod.register(a)
        cons.connect(0, first)
        into = torch.zeros(4096, dtype=torch.uint8, device=device)
        cons.read(0, 0, 4096, into, timeout_s=10)
        assert torch.equal(into, a)
        assert prod.retire(first) and not prod.retire(first)  # let go once
        if name in ("tcp", "nccl:gloo", "loopback"):  # serving nothing until the next buffer comes: refused, typed
            with pytest.raises(TransportError):
                cons.read(0, 0, 64, into, timeout_s=5)
        second = prod.register(b)
        cons.connect(0, second)
        into = torch.zeros(8192, dtype=torch.uint8, device=device)
        cons.read(0, 0, 8192, into, timeout_s=10)
        assert torch.equal(into, b)
        if shared is not None:  # what was shared before the swap is still shared: consumers keep their mappings
            assert torch.equal(cons.open_shared(0, shared)[:1000], held)
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize("name", ["loopback", "tcp", "nccl:gloo", "nixl", "auto"])
def test_a_retired_buffer_is_replaced_on_the_same_transport(name: str) -> None:
    """``retire``: the producer swaps its registered buffer (a ring released and brought back) without closing the
    transport; a consumer reconnects to the new descriptor and reads the new bytes."""
    _retire_and_replace(name, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["cuda_ipc", "auto"])
def test_a_retired_gpu_buffer_is_replaced_on_the_same_transport(name: str) -> None:
    """The same across processes on one GPU (CUDA IPC handles open only in another process than their exporter's):
    the producer swaps its buffer while the consumer keeps the tensor it mapped before the swap."""
    descs, out, step = CTX.Queue(), CTX.Queue(), CTX.Queue()
    prod = CTX.Process(target=_swapping_producer, args=(name, descs, step), daemon=True)
    cons = CTX.Process(target=_swap_consumer, args=(name, descs, out, step), daemon=True)
    prod.start(), cons.start()
    try:
        got = out.get(timeout=180)
        assert got == ["first", "second", "shared"], got
    finally:
        step.put("stop")
        for x in (prod, cons):
            x.join(10)
            if x.is_alive():
                x.kill()


def _swapping_producer(name: str, descs, step) -> None:
    t = _make(name)
    a, b, held = pattern(4096).cuda(), pattern(8192).flip(0).contiguous().cuda(), pattern(1000).cuda()
    first = t.register(a)
    descs.put((first, t.share(held)))
    step.get(timeout=120)  # the consumer read the first buffer
    ok = t.retire(first) and not t.retire(first)
    descs.put((t.register(b) if ok else None, None))
    step.get(timeout=120)


def _swap_consumer(name: str, descs, out, step) -> None:
    try:
        t, seen = _make(name), []
        first, shared = descs.get(timeout=120)
        t.connect(0, first)
        mapped = t.open_shared(0, shared)
        into = torch.zeros(8192, dtype=torch.uint8, device="cuda:0")
        t.read(0, 0, 4096, into, timeout_s=10)
        seen.append("first" if torch.equal(into[:4096].cpu(), pattern(4096)) else "first wrong")
        step.put("read")
        second, _ = descs.get(timeout=120)
        if second is not None:
            t.connect(0, second)
            t.read(0, 0, 8192, into, timeout_s=10)
            seen.append("second" if torch.equal(into.cpu(), pattern(8192).flip(0)) else "second wrong")
        seen.append("shared" if torch.equal(mapped[:1000].cpu(), pattern(1000)) else "shared wrong")
        out.put(seen)
    except BaseException as e:
        out.put([f"{type(e).__name__}: {e}"])


def test_unknown_transport_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="known: .*tcp"):
        make_transport("carrier-pigeon")




@pytest.mark.parametrize("name", ["tcp", "nccl"])
def test_wrong_token_is_refused_before_any_byte_or_group(name: str) -> None:
    kw = {"backend": "gloo"} if name == "nccl" else {}
    prod = make_transport(name, token="right", **kw)
    desc = prod.register(pattern(1024))
    cons = make_transport(name, token="wrong", **kw)
    try:
        with pytest.raises(TransportError, match="rejected the token"):
            cons.connect(0, desc)
        assert prod.refused == 1
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_capabilities_are_declared_not_guessed(name):
    """What a transport can do beyond the contract is declared in its ``caps`` (``transport/base.py``) and matches
    the methods it has: memory sharing (source reads) and a token-authenticated data plane."""
    import importlib
    import inspect

    from shardsync.transport import transport_caps

    module, cls_name = TRANSPORTS[name]
    cls = getattr(importlib.import_module(module), cls_name)
    caps = transport_caps(name)
    assert caps.shares_memory == (hasattr(cls, "share") and hasattr(cls, "open_shared")), name
    assert caps.takes_token == ("token" in inspect.signature(cls.__init__).parameters), name
