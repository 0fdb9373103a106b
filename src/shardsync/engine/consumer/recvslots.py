"""The consumer's receive slots: a fixed pool of group-sized buffers shared by its per-producer pullers.

Its rules (a slot per group on first bytes, the head rule, freed once applied) are ``engine/schedule.py``'s
rule 9; ``max_in_use`` records the most slots used at once::

    slots = RecvSlots(4, ["pre", "model.layers.0", "post"])
    i = slots.acquire("model.layers.0", timeout_s=10, what="group 'model.layers.0'")
    slots.release("model.layers.0")

:class:`SlotPool` is one sync's view of them: the consumer's slot buffers under those rules, given up on once the
sync fails (``stop``)::

    pool = SlotPool(buffers, order, timeout_s=120)
    buf = pool.acquire("model.layers.0", what="group 'model.layers.0' of version 3")
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

from ...errors import TransportError

__all__ = ["RecvSlots", "SlotPool"]


class RecvSlots:
    def __init__(self, n: int, order: Sequence[str]):
        if n < 2:
            raise ValueError(f"a consumer needs at least 2 receive slots, got {n}")
        self.n, self.order = n, list(order)
        self.free = list(range(n))
        self.slot: dict[str, int] = {}
        self.granted: set[str] = set()
        self._head = 0
        self.max_in_use = 0
        self.cv = threading.Condition()

    def _is_head(self, g: str) -> bool:
        while self._head < len(self.order) and self.order[self._head] in self.granted:
            self._head += 1
        return self._head < len(self.order) and self.order[self._head] == g

    def acquire(self, g: str, *, timeout_s: float, what: str, abort: "threading.Event | None" = None) -> int:
        """The slot of group ``g`` (allocated on first use, under the head rule); waits up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while True:
                if g in self.slot:
                    return self.slot[g]
                if self.free and (len(self.free) >= 2 or self._is_head(g)):
                    i = self.free.pop(0)
                    self.slot[g] = i
                    self.granted.add(g)
                    self.max_in_use = max(self.max_in_use, self.n - len(self.free))
                    return i
                if abort is not None and abort.is_set():
                    raise TransportError(f"gave up waiting for a receive slot for {what}: the sync is failing")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"no receive slot for {what} within {timeout_s} s (slots held by "
                                         f"{sorted(self.slot)}, waiting to be completed and applied)")
                self.cv.wait(min(left, 0.25))

    def release(self, g: str) -> None:
        with self.cv:
            self.free.append(self.slot.pop(g))
            self.cv.notify_all()

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()


class SlotPool:
    """One sync's receive slots: ``buffers`` (the consumer's, allocated once) handed out per group by
    :class:`RecvSlots`; waits give up once :meth:`stop` is called (the sync is failing)."""

    def __init__(self, buffers: Sequence[Any], order: Sequence[str], *, timeout_s: float):
        self.buffers, self.timeout_s = list(buffers), timeout_s
        self.slots = RecvSlots(len(self.buffers), order)
        self.stopped = threading.Event()

    @property
    def max_in_use(self) -> int:
        return self.slots.max_in_use

    def acquire(self, group: str, *, what: str) -> Any:
        """The buffer of ``group``'s slot (waits under the slot rules, up to ``timeout_s``)."""
        return self.buffers[self.slots.acquire(group, timeout_s=self.timeout_s, abort=self.stopped, what=what)]

    def view(self, group: str) -> Any:
        """The buffer ``group`` holds, or None."""
        i = self.slots.slot.get(group)
        return None if i is None else self.buffers[i]

    def free(self, group: str) -> None:
        if group in self.slots.slot:
            self.slots.release(group)

    def stop(self) -> None:
        self.stopped.set()
        self.slots.wake()
