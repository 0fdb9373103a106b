"""NIXL transport: one-sided READs of a producer's registered buffer (UCX by default).

The producer registers its buffer once and ships the descriptor (agent metadata included) through the
control plane; consumers load that metadata and pull ranges with NIXL READ transfers. Destination
tensors are registered on first use and cached, so reading into a few fixed receive buffers costs one
registration each::

    prod = NixlTransport(name="trainer-0")
    desc = prod.register(buf)                       # buf: contiguous uint8, CPU or CUDA
    cons = NixlTransport()
    cons.connect(0, desc)
    cons.read(0, 4096, 1 << 20, out, timeout_s=5)   # out[:1 MiB] = buf[4096 : 4096 + 1 MiB]

``nixl`` is imported when the class is instantiated, so importing this module never needs it.
"""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TransportError
from .base import Caps, check_range

__all__ = ["NixlTransport"]

_MAX_LOCAL_REGS = 16
"""Destination registrations kept at once (least recently used ones are deregistered first)."""


@dataclass
class _Remote:
    agent: str
    addr: int
    nbytes: int
    mem: str
    device_id: int


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.get_device()) if t.is_cuda else ("DRAM", 0)


class NixlTransport:
    name = "nixl"
    caps = Caps(one_sided=True, gpu=True, can_abort=True)

    def __init__(self, *, name: str | None = None, backends: tuple[str, ...] = ("UCX",),
                 connect_timeout_s: float = 30.0):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TransportError(f"the nixl transport needs the 'nixl' package: {e}") from e
        self.agent_name = name or f"shardsync-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._backends = list(backends)
        self._connect_timeout_s = connect_timeout_s
        try:
            self._agent: Any = nixl_agent(self.agent_name, nixl_agent_config(backends=list(backends)))
        except Exception as e:
            raise TransportError(f"cannot create NIXL agent {self.agent_name!r}: {e}") from e
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransportError(f"NIXL agent {self.agent_name!r}: backends {missing} are not available")
        self._lock = threading.Lock()
        self._closed = False
        self._exported: list[tuple[torch.Tensor, Any]] = []  # producer side: (buffer, reg dlist)
        self._local: OrderedDict[tuple[int, int], tuple[torch.Tensor, Any]] = OrderedDict()
        self._remotes: dict[int, _Remote] = {}
        self._inflight: dict[Any, tuple[int, int]] = {}  # xfer handle -> destination registration

    # -- producer -------------------------------------------------------------------------------
    def register(self, buf: torch.Tensor) -> dict[str, Any]:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise TransportError("NIXL register: buffer must be a 1-D contiguous uint8 tensor")
        mem, dev = _mem(buf)
        with self._lock:
            self._check_open()
            try:
                reg = self._agent.register_memory(buf, backends=self._backends)
                meta = self._agent.get_agent_metadata()
            except Exception as e:
                raise TransportError(f"NIXL agent {self.agent_name!r}: cannot register "
                                     f"{buf.numel()} bytes of {mem}: {e}") from e
            self._exported.append((buf, reg))
        return {"agent": self.agent_name, "metadata": base64.b64encode(meta).decode("ascii"),
                "addr": buf.data_ptr(), "nbytes": buf.numel(),
                "device": "cuda" if buf.is_cuda else "cpu", "device_id": dev}

    def retire(self, desc: dict[str, Any]) -> bool:
        """Deregister the buffer ``desc`` (``register``'s answer) names; its memory may go."""
        with self._lock:
            for i, (buf, reg) in enumerate(self._exported):
                if buf.data_ptr() == desc.get("addr") and buf.numel() == desc.get("nbytes"):
                    del self._exported[i]
                    try:
                        self._agent.deregister_memory(reg, backends=self._backends)
                    except Exception:
                        return False  # the caller closes this agent (which deregisters all) and makes another
                    return True
        return False

    # -- consumer -------------------------------------------------------------------------------
    def connect(self, producer: int, desc: dict[str, Any]) -> None:
        peer = f"producer {producer} (agent {desc.get('agent')!r})"
        with self._lock:
            self._check_open()
            try:
                remote = self._agent.add_remote_agent(base64.b64decode(desc["metadata"]))
            except Exception as e:
                raise TransportError(f"NIXL: cannot load metadata of {peer}: {e}") from e
            remote = remote.decode() if isinstance(remote, bytes) else str(remote)
            old = self._remotes.get(producer)
            if old is not None and old.agent != remote:  # a restarted producer: forget its predecessor
                try:
                    self._agent.remove_remote_agent(old.agent)
                except Exception:
                    pass
            mem = "VRAM" if desc["device"] == "cuda" else "DRAM"
            self._remotes[producer] = _Remote(remote, int(desc["addr"]), int(desc["nbytes"]), mem,
                                              int(desc.get("device_id", 0)))
        deadline = time.monotonic() + self._connect_timeout_s
        while True:  # metadata loaded from bytes is usually visible at once; wait a little if not
            with self._lock:
                self._check_open()
                if self._agent.check_remote_metadata(remote):
                    break
            if time.monotonic() > deadline:
                raise TransportError(f"NIXL: metadata of {peer} not available after "
                                     f"{self._connect_timeout_s:.1f}s")
            time.sleep(0.01)

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None:
        r = self._remotes.get(producer)
        if r is None:
            self._check_open(f"read from producer {producer}")
            raise TransportError(f"NIXL: producer {producer} is not connected")
        peer = f"producer {producer} (agent {r.agent!r})"
        check_range(r.nbytes, offset, nbytes, into, peer)
        if nbytes == 0:
            return
        what = f"read [{offset}, {offset + nbytes}) from {peer}"
        deadline = time.monotonic() + timeout_s
        mem, dev = _mem(into)
        with self._lock:
            self._check_open(what)
            handle = None
            try:
                key = self._local_reg(into)
                local = self._agent.get_xfer_descs([(into.data_ptr(), nbytes, dev)], mem)
                rdesc = self._agent.get_xfer_descs([(r.addr + offset, nbytes, r.device_id)], r.mem)
                handle = self._agent.initialize_xfer("READ", local, rdesc, r.agent, backends=self._backends)
                self._inflight[handle] = key
                state = self._agent.transfer(handle)
            except Exception as e:
                if handle is not None:
                    self._release(handle)
                raise TransportError(f"NIXL {what} could not be posted: {e}") from e
        try:
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransportError(f"NIXL {what} timed out after {timeout_s:.1f}s")
                time.sleep(0)
                with self._lock:
                    if self._closed:
                        raise TransportError(f"NIXL {what} aborted: transport closed")
                    try:
                        state = self._agent.check_xfer_state(handle)
                    except Exception as e:
                        raise TransportError(f"NIXL {what} failed: {e}") from e
            if state != "DONE":
                raise TransportError(f"NIXL {what} failed (transfer state {state})")
        finally:
            with self._lock:
                self._release(handle)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for h in list(self._inflight):
                self._release(h)
            for _, reg in list(self._local.values()) + self._exported:
                try:
                    self._agent.deregister_memory(reg, backends=self._backends)
                except Exception:
                    pass
            for r in self._remotes.values():
                try:
                    self._agent.remove_remote_agent(r.agent)
                except Exception:
                    pass
            self._local.clear()
            self._exported.clear()
            self._remotes.clear()

    # -- internals (called with the lock held) --------------------------------------------------
    def _check_open(self, what: str = "") -> None:
        if self._closed:
            raise TransportError(f"NIXL transport {self.agent_name!r} is closed" + (f" ({what})" if what else ""))

    def _release(self, handle: Any) -> None:
        self._inflight.pop(handle, None)
        try:
            self._agent.release_xfer_handle(handle)  # aborts the transfer if it is still running
        except Exception:
            pass  # cannot be cancelled now; nixl keeps it on the agent's leak list and retries later

    def _local_reg(self, into: torch.Tensor) -> tuple[int, int]:
        """Register ``into`` (all of it) unless a cached registration already covers it."""
        ptr, n = into.data_ptr(), into.numel()
        for key in self._local:
            if key[0] <= ptr and ptr + n <= key[0] + key[1]:
                self._local.move_to_end(key)
                return key
        busy = set(self._inflight.values())
        for key in [k for k in self._local if k not in busy][: max(0, len(self._local) - _MAX_LOCAL_REGS + 1)]:
            self._agent.deregister_memory(self._local.pop(key)[1], backends=self._backends)
        reg = self._agent.register_memory(into, backends=self._backends)
        self._local[(ptr, n)] = (into, reg)
        return (ptr, n)
