"""Announcing packed groups once their pack has run — off the gather thread on a GPU.

On a GPU the producer's gather thread queues group g's pack on its side stream and moves straight on to
gathering g+1; a publisher thread waits (an event, with a deadline) until that pack has run, then runs the
announcement (checksums, ``Ready`` for the consumers), in pack order. Tensors the schedule drops meanwhile
are ``hold``-ed until a later pack event has completed, so the caching allocator never hands their memory
to new work while a queued pack still reads them. On CPU everything runs at once, in the caller::

    pub = Publisher(lane, timeout_s=30, who="producer 0")
    pub.submit(lambda: announce("model.layers.3"), hold=dropped_tensors)
    pub.flush()          # every queued announcement made (or its failure raised)
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch

from ...errors import SyncError
from ...transport.base import wait_event
from ..lanes import Lane

__all__ = ["Publisher"]


class Publisher:
    def __init__(self, lane: Lane, *, timeout_s: float, who: str):
        self.lane, self.timeout_s, self.who = lane, timeout_s, who
        self.error: BaseException | None = None
        self._q: queue.Queue[Any] = queue.Queue()
        self._left = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        if lane.cuda:
            self._thread = threading.Thread(target=self._run, name=f"shardsync-publish-{who}", daemon=True)
            self._thread.start()

    def submit(self, announce: Callable[[], None], *, what: str, hold: list | None = None) -> None:
        """Run ``announce`` once everything queued on the lane so far has run."""
        self.check()
        if not self.lane.cuda:
            announce()
            return
        ev = torch.cuda.Event()
        ev.record(self.lane.stream)
        with self._cv:
            self._left += 1
        self._q.put((ev, announce, what, hold))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            ev, announce, what, hold = item
            try:
                if self.error is None:
                    wait_event(ev, timeout_s=self.timeout_s, what=f"{self.who}: {what}")
                    announce()
            except BaseException as e:
                self.error = e
            finally:
                del hold
                with self._cv:
                    self._left -= 1
                    self._cv.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise SyncError(f"{self.who}: announcing a packed group failed: {self.error}") from self.error

    def flush(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while self._left:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SyncError(f"{self.who}: packed groups not announced within {self.timeout_s} s")
                self._cv.wait(min(left, 0.25))
        self.check()

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)
