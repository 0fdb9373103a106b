"""The consumer's receive slots: a fixed pool of group-sized buffers shared by its per-producer pullers.

Rules (why pulling from every producer at once cannot deadlock):

1. Every producer packs in transfer order and every puller asks for its producer's groups in that order,
   so each puller's groups are an increasing subsequence of one order (``engine/schedule.py`` rule 3).
2. A group gets a slot the first time any of its producers' bytes arrive; the others write into the same
   slot. The slot is freed once the group has been applied.
3. A group may take the LAST free slot only if it is the head: the first group in transfer order that has
   no slot yet. So the smallest incomplete group can always get a slot, its pullers are never blocked
   behind a later group, and every sync finishes. Any other group needs two free slots.
4. The pool is allocated once (``n`` slots of the largest group's size): the consumer's receive memory
   never exceeds ``n * slot_bytes`` (``max_in_use`` records the most slots used at once).

    slots = RecvSlots(4, ["pre", "model.layers.0", "post"])
    i = slots.acquire("model.layers.0", timeout_s=10, what="group 'model.layers.0'")
    slots.release("model.layers.0")
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from ..errors import TransportError

__all__ = ["RecvSlots"]


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
        """The slot of group ``g`` (allocated on first use, rule 2-3); waits up to ``timeout_s``."""
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
