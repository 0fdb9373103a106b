"""torch.distributed transport: point-to-point send/recv (gloo on CPU).

The producer's serving thread receives a read request (offset, nbytes) from any rank and sends the
range back; a consumer sends the request and waits for the bytes with a timeout. All ranks —
producers and consumers — belong to one process group passed in (use a group dedicated to
transfers, so that serving never interleaves with the trainer's own collectives)::

    t = TorchDistTransport(group=transfer_group)
    desc = t.register(buf)                   # producer rank
    t.connect(0, desc); t.read(0, 0, n, out, timeout_s=10)   # consumer rank
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TransportError
from .base import Caps, check_range

_REQ_TAG, _DATA_TAG = 7301, 7302
_STOP = -1


class TorchDistTransport:
    name = "torch"
    caps = Caps(one_sided=False, gpu=True, can_abort=False)

    def __init__(self, *, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise TransportError("torch transport needs an initialised torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank()
        self._buf: torch.Tensor | None = None
        self._peers: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._broken: set[int] = set()
        self._thread: threading.Thread | None = None

    def register(self, buf: torch.Tensor) -> dict[str, Any]:
        self._buf = buf
        self._thread = threading.Thread(target=self._serve, name="shardsync-torch-serve", daemon=True)
        self._thread.start()
        return {"rank": self.rank, "nbytes": buf.numel()}

    def _serve(self) -> None:
        assert self._buf is not None
        req = torch.empty(2, dtype=torch.int64)
        while True:
            try:
                src = dist.recv(req, group=self.group, tag=_REQ_TAG)
            except RuntimeError:
                return  # process group torn down
            off, n = int(req[0]), int(req[1])
            if off == _STOP:
                return
            dist.send(self._buf[off: off + n], dst=src, group=self.group, tag=_DATA_TAG)

    def connect(self, producer: int, desc: dict[str, Any]) -> None:
        self._peers[producer] = desc

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None:
        desc = self._peers.get(producer)
        if desc is None:
            raise TransportError(f"torch: producer {producer} is not connected")
        check_range(int(desc["nbytes"]), offset, nbytes, into, f"producer {producer} (rank {desc['rank']})")
        if nbytes == 0:
            return
        if producer in self._broken:  # gloo cannot cancel a posted receive: it would take the next reply
            raise TransportError(f"torch: producer {producer} (rank {desc['rank']}) is unusable after an earlier "
                                 "failed read")
        with self._lock:  # one outstanding request per consumer keeps replies in order
            try:
                wait = timedelta(seconds=timeout_s)
                req = dist.isend(torch.tensor([offset, nbytes], dtype=torch.int64), dst=int(desc["rank"]),
                                 group=self.group, tag=_REQ_TAG)
                work = dist.irecv(into[:nbytes], src=int(desc["rank"]), group=self.group, tag=_DATA_TAG)
                if not req.wait(timeout=wait) or not work.wait(timeout=wait):
                    self._broken.add(producer)
                    raise TransportError(f"torch: read [{offset}, {offset + nbytes}) from producer {producer} "
                                         f"(rank {desc['rank']}) did not complete within {timeout_s} s")
            except RuntimeError as e:
                self._broken.add(producer)
                raise TransportError(f"torch: read [{offset}, {offset + nbytes}) from producer {producer} "
                                     f"(rank {desc['rank']}) failed: {str(e).splitlines()[0]}") from None

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            try:  # wake our own serving thread
                dist.send(torch.tensor([_STOP, 0], dtype=torch.int64), dst=self.rank, group=self.group, tag=_REQ_TAG)
            except RuntimeError:
                pass
            self._thread.join(timeout=2)
        self._peers.clear()
