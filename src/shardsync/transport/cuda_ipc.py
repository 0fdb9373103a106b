"""CUDA IPC transport: a consumer on the same node maps the producer's GPU buffer and copies from it.

For trainer and engine colocated on one node (or one GPU set): the producer exports its registered
buffer's CUDA IPC handle (JSON-safe descriptor, base64); the consumer opens it once and a read is one
device-to-device copy (peer copy over NVLink, ~390 GB/s on H200s), waited for with a deadline.
Liveness of the producer comes from the control plane (a dead producer's ``WaitReady`` fails), since a
mapped allocation gives no signal of its own::

    desc = CudaIpcTransport().register(ring)                       # producer (cuda:0)
    t = CudaIpcTransport(); t.connect(0, desc); t.read(0, off, n, recv, timeout_s=10)   # consumer
"""

from __future__ import annotations

import base64
import time
from typing import Any

import torch

from ..errors import TransportError
from .base import Caps, check_range


def _b(x: bytes | None) -> str | None:
    return None if x is None else base64.b64encode(x).decode()


def _u(x: str | None) -> bytes | None:
    return None if x is None else base64.b64decode(x)


class CudaIpcTransport:
    name = "cuda_ipc"
    caps = Caps(one_sided=True, gpu=True, can_abort=False)

    def __init__(self) -> None:
        self._keep: list[torch.Tensor] = []
        self._peers: dict[int, torch.Tensor] = {}

    def register(self, buf: torch.Tensor) -> dict[str, Any]:
        if not buf.is_cuda or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise TransportError("cuda_ipc registers contiguous uint8 CUDA buffers only")
        (device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = \
            buf.untyped_storage()._share_cuda_()
        self._keep.append(buf)
        return {"device": int(device), "handle": _b(handle), "size": int(size), "offset": int(offset),
                "rc_handle": _b(rc_handle), "rc_offset": int(rc_offset), "ev_handle": _b(ev_handle),
                "ev_sync": bool(ev_sync), "tensor_offset": buf.storage_offset(), "nbytes": buf.numel()}

    def connect(self, producer: int, desc: dict[str, Any]) -> None:
        try:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                desc["device"], _u(desc["handle"]), desc["size"], desc["offset"], _u(desc["rc_handle"]),
                desc["rc_offset"], _u(desc["ev_handle"]), desc["ev_sync"])
        except RuntimeError as e:
            raise TransportError(f"cuda_ipc: cannot open producer {producer}'s buffer: {e}") from None
        t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{desc['device']}")
        t.set_(storage, desc["tensor_offset"], (desc["nbytes"],))
        self._peers[producer] = t

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None:
        remote = self._peers.get(producer)
        if remote is None:
            raise TransportError(f"cuda_ipc: producer {producer} is not connected")
        check_range(remote.numel(), offset, nbytes, into, f"producer {producer}")
        if nbytes == 0:
            return
        into[:nbytes].copy_(remote[offset: offset + nbytes], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(into.device))
        deadline = time.monotonic() + timeout_s
        while not ev.query():
            if time.monotonic() > deadline:
                raise TransportError(f"cuda_ipc: read [{offset}, {offset + nbytes}) from producer {producer} did "
                                     f"not complete within {timeout_s} s")
            time.sleep(0)

    def close(self) -> None:
        self._peers.clear()
        self._keep.clear()
