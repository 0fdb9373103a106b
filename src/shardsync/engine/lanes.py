"""Side streams for the engine's device work: pack on the trainer's GPU, apply on the worker's GPU.

A :class:`Lane` is one CUDA stream of one device (a no-op on CPU). Work runs on it with ``with lane:``; it
first waits for whatever the caller's current stream had queued (the optimizer step that wrote the weights,
say), and ``fence`` waits — with a deadline, polling an event, never a device-wide synchronize — until what
was queued on the lane has run, so that the host may publish a ring slot or free a receive slot::

    lane = Lane("cuda:0")
    with lane:
        packer.pack(full, ring_slot)
    lane.fence(timeout_s=30, what="packing group 'model.layers.3'")
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from typing import Any

import torch

from ..transport.base import wait_event

__all__ = ["Lane", "device_of", "hot_path"]


def device_of(device: "str | torch.device | None") -> torch.device:
    return torch.device("cpu" if device is None else device)


class Lane:
    def __init__(self, device: "str | torch.device | None"):
        self.device = device_of(device)
        self.cuda = self.device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._ctx: Any = None

    def __enter__(self) -> "Lane":
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._ctx = torch.cuda.stream(self.stream)
        else:
            self._ctx = contextlib.nullcontext()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)

    def record(self) -> Any:
        """An event after the lane's queued work (None on CPU, where the work has run)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def fence(self, *, timeout_s: float, what: str) -> None:
        """Return once the lane's queued work has run; a GPU that does not finish it in time is an error."""
        if not self.cuda:
            return
        ev = torch.cuda.Event()
        ev.record(self.stream)
        wait_event(ev, timeout_s=timeout_s, what=what)


_hot = {"depth": 0, "interval": 0.0, "gc": True}
_hot_lock = threading.Lock()


@contextlib.contextmanager
def hot_path(switch_interval_s: "float | None"):
    """While a sync runs (nested or concurrent syncs share one scope): the interpreter's thread switch interval
    is lowered to ``switch_interval_s`` and the cyclic garbage collector paused, then both restored. The engine's
    threads (control replies, announcements, pullers) otherwise wait up to 5 ms for the GIL behind a thread busy
    in Python, and a full collection of a large heap stalls a sync for tens of milliseconds. None: leave both."""
    if switch_interval_s is None:
        yield
        return
    with _hot_lock:
        if _hot["depth"] == 0:
            _hot["interval"], _hot["gc"] = sys.getswitchinterval(), gc.isenabled()
            sys.setswitchinterval(switch_interval_s)
            gc.disable()
        _hot["depth"] += 1
    try:
        yield
    finally:
        with _hot_lock:
            _hot["depth"] -= 1
            if _hot["depth"] == 0:
                sys.setswitchinterval(_hot["interval"])
                if _hot["gc"]:
                    gc.enable()
