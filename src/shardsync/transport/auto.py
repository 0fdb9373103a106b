"""``auto``: the producer offers every transport that can serve its buffer; each consumer picks, per producer,
the best one for where the two sit.

Order, from ``benchmarks/gpu_sync.py`` on two H200s (README, "GPU"):

* GPU buffer, same node: ``SAME_NODE`` — ``cuda_ipc`` first (a stream-ordered peer copy from the producer's
  ring, no second rank, works when the trainer and the engine share one GPU), then ``nccl``, then ``nixl``.
* GPU buffer, another node: ``nixl`` (one-sided RDMA READ) when installed, else ``nccl``.
* CPU buffer: ``tcp``.

A candidate that fails to connect (say, CUDA IPC across containers) is skipped for the next::

    t = AutoTransport(host="10.0.0.5", token="s3cret")
    desc = t.register(ring)                  # producer: {"auto": {"cuda_ipc": ..., "nccl": ..., ...}, "node": ...}
    t.connect(0, desc); t.read(0, off, n, slot, timeout_s=30)    # consumer: cuda_ipc if on the same node
    t.chosen                                 # {0: "cuda_ipc"}
"""

from __future__ import annotations

import importlib.util
import socket
from typing import Any

import torch

from ..errors import TransportError
from .base import Caps, make_transport

__all__ = ["AutoTransport", "SAME_NODE", "CROSS_NODE"]

SAME_NODE = ("cuda_ipc", "nccl", "nixl")
CROSS_NODE = ("nixl", "nccl")


class AutoTransport:
    name = "auto"
    caps = Caps(one_sided=False, gpu=True, can_abort=True, shares_memory=True, takes_token=True)

    def __init__(self, *, host: str = "127.0.0.1", token: str = "", advertise_host: str | None = None,
                 nixl: bool | None = None):
        self.host, self.token, self.advertise_host = host, token, advertise_host
        self.nixl = importlib.util.find_spec("nixl") is not None if nixl is None else nixl
        self._mine: dict[str, Any] = {}  # kind -> transport instance (shared by every producer)
        self._use: dict[int, Any] = {}
        self.chosen: dict[int, str] = {}
        """Producer rank -> the transport this consumer reads it with."""

    def _get(self, kind: str) -> Any:
        if kind not in self._mine:
            kw = {"host": self.host, "token": self.token, "advertise_host": self.advertise_host} \
                if kind in ("tcp", "nccl") else {}
            self._mine[kind] = make_transport(kind, **kw)
        return self._mine[kind]

    def register(self, buf: torch.Tensor) -> dict[str, Any]:
        kinds = (["cuda_ipc", "nccl"] + (["nixl"] if self.nixl else [])) if buf.is_cuda else ["tcp"]
        return {"auto": {k: self._get(k).register(buf) for k in kinds}, "node": socket.gethostname()}

    def retire(self, desc: dict[str, Any]) -> bool:
        """Let go of the buffer ``desc`` names, in every transport that registered it; False where one cannot (the
        caller then closes this transport and makes another)."""
        offered = desc.get("auto", {})
        done = [getattr(self._mine.get(k), "retire", lambda _d: False)(d) for k, d in offered.items()]
        return bool(done) and all(done)

    def connect(self, producer: int, desc: dict[str, Any]) -> None:
        offered = desc.get("auto")
        if not isinstance(offered, dict):
            raise TransportError(f"auto: producer {producer} does not offer a choice of transports (desc {list(desc)})")
        same = desc.get("node") == socket.gethostname()
        order = (SAME_NODE if same else CROSS_NODE) if "tcp" not in offered else ("tcp",)
        tried = []
        for kind in order:
            if kind not in offered or (kind == "nixl" and not self.nixl):
                continue
            try:
                self._get(kind).connect(producer, offered[kind])
            except TransportError as e:
                tried.append(f"{kind}: {e}")
                continue
            self._use[producer], self.chosen[producer] = self._mine[kind], kind
            return
        raise TransportError(f"auto: no transport reaches producer {producer} (offered {sorted(offered)}, "
                             f"{'same' if same else 'another'} node; tried: {'; '.join(tried) or 'none usable'})")

    def view(self, producer: int) -> torch.Tensor | None:
        """The chosen transport's view of producer ``producer``'s buffer, if it offers one (``cuda_ipc``)."""
        view = getattr(self._use.get(producer), "view", None)
        return view(producer) if view is not None else None

    def share(self, t: torch.Tensor) -> dict[str, Any]:
        """Source reads (``engine/source_reads/source_share.py``): a trainer tensor's storage, through ``cuda_ipc`` (only consumers
        that chose it map it; the others say so and are sent packed groups)."""
        if not t.is_cuda:
            raise TransportError("auto shares CUDA tensors only (through cuda_ipc)")
        return self._get("cuda_ipc").share(t)

    def open_shared(self, producer: int, desc: dict[str, Any]) -> torch.Tensor:
        if self.chosen.get(producer) != "cuda_ipc":
            raise TransportError(f"auto: producer {producer} is read with {self.chosen.get(producer)!r}, not cuda_ipc: "
                                 "its tensors cannot be mapped here")
        return self._mine["cuda_ipc"].open_shared(producer, desc)

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None:
        t = self._use.get(producer)
        if t is None:
            raise TransportError(f"auto: producer {producer} is not connected")
        t.read(producer, offset, nbytes, into, timeout_s=timeout_s)

    def close(self) -> None:
        for t in self._mine.values():
            t.close()
        self._mine.clear()
        self._use.clear()
