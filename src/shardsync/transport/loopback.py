"""In-process transport: a read is a memory copy from a buffer registered in this process.

    t = LoopbackTransport()
    desc = t.register(buf); t.connect(0, desc); t.read(0, 0, 64, out, timeout_s=1)
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

from ..errors import TransportError
from .base import Caps, check_range

_REGISTRY: dict[int, torch.Tensor] = {}
_IDS = itertools.count()
_LOCK = threading.Lock()


class LoopbackTransport:
    name = "loopback"
    caps = Caps(one_sided=True, gpu=True, can_abort=True, cross_process=False, shares_memory=True)

    def __init__(self) -> None:
        self._mine: list[int] = []
        self._peers: dict[int, int] = {}

    def register(self, buf: torch.Tensor) -> dict[str, Any]:
        with _LOCK:
            key = next(_IDS)
            _REGISTRY[key] = buf
        self._mine.append(key)
        return {"key": key, "nbytes": buf.numel()}

    def retire(self, desc: dict[str, Any]) -> bool:
        """Let go of the buffer ``desc`` names (``share``'s registrations stay)."""
        key = desc.get("key")
        if key not in self._mine:
            return False
        self._mine.remove(key)
        with _LOCK:
            _REGISTRY.pop(key, None)
        return True

    def connect(self, producer: int, desc: dict[str, Any]) -> None:
        self._peers[producer] = int(desc["key"])

    def view(self, producer: int) -> torch.Tensor | None:
        """Producer ``producer``'s registered buffer itself (direct reads)."""
        key = self._peers.get(producer)
        return _REGISTRY.get(key) if key is not None else None

    def share(self, t: torch.Tensor) -> dict[str, Any]:
        """Source reads (``engine/source_reads/source_share.py``): the storage holding ``t``, registered in this process."""
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), 0,
                                                                         (t.untyped_storage().nbytes(),))
        return self.register(whole)

    def open_shared(self, producer: int, desc: dict[str, Any]) -> torch.Tensor:
        """A storage producer ``producer`` shared: the uint8 tensor over all of it."""
        key = desc.get("key") if isinstance(desc, dict) else None
        buf = _REGISTRY.get(key) if isinstance(key, int) else None
        if buf is None:
            raise TransportError(f"loopback: producer {producer} shared no tensor under {desc!r}")
        return buf

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None:
        key = self._peers.get(producer)
        buf = _REGISTRY.get(key) if key is not None else None
        if buf is None:
            raise TransportError(f"loopback: producer {producer} is not connected or has closed its buffer")
        check_range(buf.numel(), offset, nbytes, into, f"producer {producer}")
        into[:nbytes].copy_(buf[offset: offset + nbytes])

    def close(self) -> None:
        with _LOCK:
            for key in self._mine:
                _REGISTRY.pop(key, None)
        self._mine.clear()
        self._peers.clear()
