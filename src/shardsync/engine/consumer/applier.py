"""The consumer's applier: one thread applying each group whose every part has landed, while pulls go on.

It follows ``engine/schedule.py``'s rule 10. Groups come from the sync's :class:`~.puller.PullRound` (in the
order they complete, which may differ from transfer order); each is applied on the consumer's lane
(``apply(group, receive slot)``, or ``apply(group, ChunkParts)`` when chunks were read directly from a producer's
mapped ring or its tensors), fenced (an event with a deadline, never a device synchronize) while the next groups'
applies are already queued on the GPU, and its receive slot freed — or, read directly, the group released to its
producers. After a failure nothing more is applied; slots are still freed::

    applier = Applier(ctx, rnd, apply)
    applier.start()
    ...                              # pullers hand it groups through rnd.landed
    finished = applier.finish(timeout_s=120)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from .pullcontext import PullContext
from ...transport.base import wait_event

if TYPE_CHECKING:
    from .puller import PullRound

__all__ = ["Applier", "DEPTH"]

DEPTH = 3
"""Groups whose apply is launched and not yet fenced, at most."""


class Applier(threading.Thread):
    """The apply thread of one consumer sync (schedule rule 10)."""

    def __init__(self, ctx: PullContext, rnd: PullRound, apply: Callable[[str, Any], None]):
        super().__init__(name=f"shardsync-apply-{ctx.id}", daemon=True)
        self.ctx, self.rnd, self.apply = ctx, rnd, apply
        self.seconds = 0.0
        """Time spent applying (``stats["apply_s"]``)."""
        self.applied_any = False
        """Some group's apply began: after a failure the engine holds a mix of versions (``Consumer.torn``)."""

    def run(self) -> None:
        """Launch each group's apply as it comes; retire it (its fence, then release / free) once ``DEPTH`` applies
        are in flight or nothing new has landed: the GPU runs group g's copies while the host prepares g+1's."""
        rnd = self.rnd
        flight: deque[tuple[str, Any, float]] = deque()
        while True:
            if flight and (len(flight) >= DEPTH or rnd.complete.empty()):
                self._retire(*flight.popleft())
                continue
            g = rnd.complete.get()
            if g is None:
                while flight:
                    self._retire(*flight.popleft())
                return
            launched = self._launch(g)
            if launched is not None:
                flight.append(launched)

    def _launch(self, g: str) -> tuple[str, Any, float] | None:
        lane, rnd = self.ctx.lane, self.rnd
        t0 = time.perf_counter()
        try:
            if rnd.errors:
                rnd.free(g)
                return None
            self.applied_any = True
            with lane:
                self.apply(g, rnd.take(g))
            return g, lane.record(), t0
        except BaseException as e:  # surfaces in the calling thread
            rnd.fail(e)
            rnd.free(g)
            return None

    def _retire(self, g: str, ev: Any, t0: float) -> None:
        ctx, rnd = self.ctx, self.rnd
        try:
            if ev is not None:
                wait_event(ev, timeout_s=ctx.timeout_s, what=f"consumer {ctx.id}: applying group {g!r}")
            self.seconds += time.perf_counter() - t0
            if not rnd.errors:
                rnd.applied(g)
        except BaseException as e:
            rnd.fail(e)
        finally:
            rnd.free(g)

    def finish(self, *, timeout_s: float) -> bool:
        """No more groups: wait up to ``timeout_s`` for the queued ones; True once the thread has ended."""
        self.rnd.complete.put(None)
        self.join(timeout=timeout_s)
        return not self.is_alive()
