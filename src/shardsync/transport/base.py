"""The transport contract: a consumer pulls byte ranges of a producer's registered buffer.

From the engine's point of view every transport is one-sided: the producer registers its buffer once
and hands out a descriptor; a consumer connects with that descriptor and ``read``s ranges whenever the
control plane says a range holds a packed chunk. Two-sided mechanisms (sockets, gloo send/recv) hide
their serving thread behind ``register``. Which side calls what:

=====================  ==========  =====================================================================
method                 side        what
=====================  ==========  =====================================================================
``register(buf)``      producer    register ``buf`` (once, at init); returns a JSON-safe descriptor
``connect(p, desc)``   consumer    connect to producer ``p``'s registered buffer (once, at init)
``read(p, off, n, into, timeout_s)``  consumer  copy bytes ``[off, off+n)`` of ``p``'s buffer into ``into``
``close()``            both        release everything; pending reads fail with TransportError
``view(p)`` (optional) consumer    ``p``'s buffer as a tensor of this process (``cuda_ipc``, ``loopback``):
                                   the consumer may copy straight from it into its parameters (direct reads)
``retire(desc)`` (opt.) producer    let go of the buffer ``desc`` names; ``register`` may name the next one on the
                                   same instance, and what ``share`` exported stays valid (True: done)
``share(t)``           producer    with ``caps.shares_memory``: a descriptor of tensor ``t`` where it lies
``open_shared(p, d)``  consumer    with ``caps.shares_memory``: that tensor of producer ``p``, mapped here
=====================  ==========  =====================================================================

Every wait has a timeout; a dead peer surfaces as :class:`~shardsync.errors.TransportError` naming the
peer and the range, never as a hang::

    t = make_transport("tcp", host="127.0.0.1")
    desc = t.register(buf)                  # producer
    t.connect(0, desc); t.read(0, 128, 64, out, timeout_s=5)   # consumer
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Caps", "Transport", "make_transport", "make_group_transport", "transport_caps", "TRANSPORTS"]


@dataclass(frozen=True)
class Caps:
    one_sided: bool
    """The producer's CPU takes no part in a read (RDMA-style)."""
    gpu: bool
    """Can register and read GPU memory."""
    can_abort: bool
    """``close`` interrupts reads in flight."""
    cross_process: bool = True
    """Producer and consumer may live in different processes."""
    shares_memory: bool = False
    """Implements ``share(t)`` (producer: a descriptor of tensor ``t`` where it lies) and ``open_shared(p, desc)``
    (consumer: that tensor mapped into this process): source reads (``engine/source_reads/``) are offered."""
    takes_token: bool = False
    """Its data plane is authenticated with the group's token (made with ``token=``; :func:`make_group_transport`)."""


@runtime_checkable
class Transport(Protocol):
    name: str
    caps: Caps

    def register(self, buf: torch.Tensor) -> dict[str, Any]: ...

    def connect(self, producer: int, desc: dict[str, Any]) -> None: ...

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None: ...

    def close(self) -> None: ...


TRANSPORTS = {
    "loopback": ("shardsync.transport.loopback", "LoopbackTransport"),
    "tcp": ("shardsync.transport.tcp", "TcpTransport"),
    "torch": ("shardsync.transport.torchdist", "TorchDistTransport"),
    "nixl": ("shardsync.transport.nixl", "NixlTransport"),
    "cuda_ipc": ("shardsync.transport.cuda_ipc", "CudaIpcTransport"),
    "nccl": ("shardsync.transport.nccl", "NcclTransport"),
    "auto": ("shardsync.transport.auto", "AutoTransport"),
    "rdt": ("shardsync.transport.rdt", "RdtTransport"),
}


def make_transport(name: str, **kwargs: Any) -> Transport:
    """Instantiate a transport by name (imported lazily: nixl/torch.distributed only when asked for)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(TRANSPORTS)}")
    module, cls = TRANSPORTS[name]
    return getattr(import_module(module), cls)(**kwargs)


def transport_caps(name: str) -> Caps:
    """The capabilities transport ``name`` declares (its class imported, not instantiated)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(TRANSPORTS)}")
    module, cls = TRANSPORTS[name]
    return getattr(import_module(module), cls).caps


def make_group_transport(name: str, *, token: str, **kwargs: Any) -> Transport:
    """A transport for a group member: one whose data plane is authenticated (``caps.takes_token``) gets the
    group's token unless ``kwargs`` name another."""
    if transport_caps(name).takes_token:
        kwargs.setdefault("token", token)
    return make_transport(name, **kwargs)


def check_range(buf_nbytes: int, offset: int, nbytes: int, into: torch.Tensor, peer: str) -> None:
    from ..errors import TransportError

    if offset < 0 or nbytes < 0 or offset + nbytes > buf_nbytes:
        raise TransportError(f"read [{offset}, {offset + nbytes}) is outside {peer}'s buffer of {buf_nbytes} bytes")
    if into.dtype != torch.uint8 or into.numel() < nbytes or not into.is_contiguous():
        raise TransportError(f"read destination must be a contiguous uint8 tensor of >= {nbytes} bytes")


def wait_event(ev: Any, *, timeout_s: float, what: str) -> None:
    """Poll a CUDA event until it has completed (spinning briefly, then sleeping), bounded by ``timeout_s``:
    the host waits for one stream's work, never for the whole device."""
    poll(ev.query, timeout_s=timeout_s, what=lambda: f"{what} did not complete on the GPU within {timeout_s} s")


def poll(done: Any, *, timeout_s: float, what: Any) -> None:
    """Wait until ``done()``: a few yields, then short sleeps — many threads wait at once (pullers, the apply,
    the publisher), and spinning on the GIL would starve the ones doing Python work."""
    from ..errors import TransportError

    deadline = time.monotonic() + timeout_s
    spins = 0
    while not done():
        if time.monotonic() > deadline:
            raise TransportError(what())
        spins += 1
        time.sleep(0 if spins < 16 else 20e-6)
