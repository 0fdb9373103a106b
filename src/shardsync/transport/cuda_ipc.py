"""CUDA IPC transport: a consumer on the same node maps the producer's GPU buffer and copies from it.

For trainer and engine colocated on one node (or one GPU set): the producer exports its registered
buffer's CUDA IPC handle (JSON-safe descriptor, base64); the consumer opens it once and a read is one
device-to-device copy (peer copy over NVLink, ~390 GB/s on H200s), waited for with a deadline.
Liveness of the producer comes from the control plane (a dead producer's ``WaitReady`` fails), since a
mapped allocation gives no signal of its own::

    desc = CudaIpcTransport().register(ring)                       # producer (cuda:0)
    t = CudaIpcTransport(); t.connect(0, desc); t.read(0, off, n, recv, timeout_s=10)   # consumer

Source reads (``engine/source_reads/source_share.py``): ``share(t)`` exports the storage holding a trainer tensor (once; the
descriptor is cached by the caller) and ``open_shared(p, desc)`` maps it into the consumer as a uint8 tensor over the
whole storage, so a colocated consumer scatters straight from the trainer's weights (no pack pass, no ring).
"""

from __future__ import annotations

import base64
import ctypes
import logging
import socket
import threading
from typing import Any

import torch

from ..errors import TransportError
from .base import Caps, check_range, wait_event


def _b(x: bytes | None) -> str | None:
    return None if x is None else base64.b64encode(x).decode()


def _u(x: str | None) -> bytes | None:
    return None if x is None else base64.b64decode(x)


def _export(t: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC descriptor of the storage holding ``t`` (JSON-safe)."""
    (device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = t.untyped_storage()._share_cuda_()
    return {"device": int(device), "handle": _b(handle), "size": int(size), "offset": int(offset),
            "rc_handle": _b(rc_handle), "rc_offset": int(rc_offset), "ev_handle": _b(ev_handle),
            "ev_sync": bool(ev_sync), "node": socket.gethostname()}


_IPC_HANDLE = 64
"""Bytes of a ``cudaIpcMemHandle_t``. torch exports a plain ``cudaMalloc`` block as one, after a version byte and
the kind ``c`` (an expandable segment's handle, kind ``e``, maps its pieces by size: the driver checks those)."""


def _malloc_handle(handle: bytes | None) -> bool:
    """The handle names one ``cudaMalloc`` allocation (whose range the driver can tell)."""
    if handle is None:
        return False
    return len(handle) == _IPC_HANDLE or (len(handle) == _IPC_HANDLE + 2 and handle[1:2] == b"c")


_UNCHECKED: list[str] = []
log = logging.getLogger("shardsync.cuda_ipc")


def _address_range(ptr: int, device: int) -> tuple[int, int] | str:
    """(base, size) of the allocation holding device address ``ptr`` (``cuMemGetAddressRange``), or why the driver
    cannot say. The device's primary context (torch's) is made current for the call where the thread has none: a
    thread that has not run a kernel yet has no current context, and the driver then answers
    CUDA_ERROR_INVALID_CONTEXT for any address."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no libcuda: {e}"
    u64, vp = ctypes.c_uint64, ctypes.c_void_p
    base, size, ctx, dev = u64(0), ctypes.c_size_t(0), vp(0), ctypes.c_int(0)
    get = cu.cuMemGetAddressRange_v2
    get.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
    pushed = False
    if cu.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        if cu.cuDeviceGet(ctypes.byref(dev), device) != 0 or cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            return f"no primary context on device {device}"
        pushed = cu.cuCtxPushCurrent_v2(ctx) == 0
    try:
        rc = get(ctypes.byref(base), ctypes.byref(size), u64(ptr))
    finally:
        if pushed:
            cu.cuCtxPopCurrent_v2(ctypes.byref(vp(0)))
            cu.cuDevicePrimaryCtxRelease_v2(dev)
    return (base.value, size.value) if rc == 0 else f"cuMemGetAddressRange returned CUresult {rc}"


def check_mapped(storage: Any, handle: bytes | None, offset: int, what: str) -> None:
    """A peer's descriptor names its storage's size and its offset into the allocation itself: refuse one reaching
    past the allocation the handle opened (reads there would touch memory the peer never shared, or fault the
    device). The allocation is asked for at the handle's own mapping (the storage's address less the claimed offset,
    an address the driver always knows), so a forged offset past the allocation is caught as a forged size is."""
    if not _malloc_handle(handle) or storage.nbytes() == 0:
        return
    ptr, n = storage.data_ptr(), storage.nbytes()
    if offset < 0:
        raise TransportError(f"cuda_ipc: {what} claims a negative offset {offset}: refused")
    got = _address_range(ptr - offset, storage.device.index)
    if isinstance(got, str):  # cannot be checked here: said once, not refused (an honest peer's read must not break)
        if not _UNCHECKED:
            _UNCHECKED.append(what)
            log.warning("cuda_ipc: the driver cannot tell the allocation behind %s (%s): peer descriptors' sizes "
                        "are not checked in this process", what, got)
        return
    base, size = got
    if ptr < base or ptr + n > base + size:
        raise TransportError(f"cuda_ipc: {what} claims {n} bytes at offset {ptr - base} of an allocation of "
                             f"{size} bytes: refused")


class CudaIpcTransport:
    name = "cuda_ipc"
    caps = Caps(one_sided=True, gpu=True, can_abort=False, shares_memory=True)

    def __init__(self) -> None:
        self._keep: dict[int, torch.Tensor] = {}
        """Registration number -> a buffer this producer registered (kept alive while consumers map it)."""
        self._peers: dict[int, torch.Tensor] = {}
        self._local = threading.local()

    def register(self, buf: torch.Tensor) -> dict[str, Any]:
        if not buf.is_cuda or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise TransportError("cuda_ipc registers contiguous uint8 CUDA buffers only")
        reg = max(self._keep, default=-1) + 1
        self._keep[reg] = buf
        return {**_export(buf), "tensor_offset": buf.storage_offset(), "nbytes": buf.numel(), "reg": reg}

    def retire(self, desc: dict[str, Any]) -> bool:
        """Producer: let go of the buffer ``desc`` (``register``'s answer) names; the tensors ``share`` exported stay
        shared (their descriptors stay valid), so a ring can be swapped without consumers remapping them."""
        return self._keep.pop(desc.get("reg", -1), None) is not None

    def connect(self, producer: int, desc: dict[str, Any]) -> None:
        storage = self._open(producer, desc, "buffer")
        t = torch.empty(0, dtype=torch.uint8, device=storage.device)
        t.set_(storage, desc["tensor_offset"], (desc["nbytes"],))
        self._peers[producer] = t

    def share(self, t: torch.Tensor) -> dict[str, Any]:
        """Producer: the storage holding ``t`` (a trainer tensor), exported; ``t`` starts at byte
        ``t.storage_offset() * t.element_size()`` of it."""
        if not t.is_cuda:
            raise TransportError("cuda_ipc shares CUDA tensors only")
        try:
            return _export(t)
        except RuntimeError as e:  # say, an empty storage: that group is packed instead
            raise TransportError(f"cuda_ipc: cannot share a {t.dtype} {list(t.shape)} tensor: {e}") from None

    def open_shared(self, producer: int, desc: dict[str, Any]) -> torch.Tensor:
        """Consumer: a storage producer ``producer`` shared (``share``), mapped here as a uint8 tensor over all of
        it. A malformed or stale descriptor is a TransportError."""
        storage = self._open(producer, desc, "shared tensor")
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))

    def _open(self, producer: int, desc: dict[str, Any], what: str) -> Any:
        if desc.get("node", socket.gethostname()) != socket.gethostname():
            raise TransportError(f"cuda_ipc: producer {producer} is on node {desc['node']!r}, this consumer on "
                                 f"{socket.gethostname()!r}: CUDA IPC works within one node (use nixl or nccl)")
        try:
            torch.cuda._lazy_init()
            handle = _u(desc["handle"])
            storage = torch.UntypedStorage._new_shared_cuda(
                int(desc["device"]), handle, int(desc["size"]), int(desc["offset"]),
                _u(desc["rc_handle"]), int(desc["rc_offset"]), _u(desc["ev_handle"]), bool(desc["ev_sync"]))
        except (RuntimeError, KeyError, TypeError, ValueError) as e:
            raise TransportError(f"cuda_ipc: cannot open producer {producer}'s {what}: {type(e).__name__}: {e}") \
                from None
        check_mapped(storage, handle, int(desc["offset"]), f"producer {producer}'s {what}")
        return storage

    def view(self, producer: int) -> torch.Tensor | None:
        """Producer ``producer``'s mapped buffer (for direct reads: the consumer copies straight out of it)."""
        return self._peers.get(producer)

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None:
        remote = self._peers.get(producer)
        if remote is None:
            raise TransportError(f"cuda_ipc: producer {producer} is not connected")
        check_range(remote.numel(), offset, nbytes, into, f"producer {producer}")
        if nbytes == 0:
            return
        src_s, dst_s = self._streams(remote.device, into.device)
        with torch.cuda.stream(src_s), torch.cuda.stream(dst_s):  # a peer copy runs on the source's stream
            into[:nbytes].copy_(remote[offset: offset + nbytes], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(dst_s)
        wait_event(ev, timeout_s=timeout_s, what=f"cuda_ipc: read [{offset}, {offset + nbytes}) from producer {producer}")

    def _streams(self, src: torch.device, dst: torch.device) -> tuple[Any, Any]:
        """This thread's copy streams (one puller thread per producer copies concurrently with the others and
        with the engine's apply stream, instead of queueing behind them on the default stream)."""
        key = (src.index, dst.index)
        mine = getattr(self._local, "streams", None)
        if mine is None:
            mine = self._local.streams = {}
        if key not in mine:
            s = torch.cuda.Stream(src)
            mine[key] = (s, s if src == dst else torch.cuda.Stream(dst))
        return mine[key]

    def close(self) -> None:
        self._peers.clear()
        self._keep.clear()
