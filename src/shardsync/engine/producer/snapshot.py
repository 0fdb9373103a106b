"""Non-blocking syncs (asynchronous RL): the tensors a producer serves, copied aside so training can go on.

``Producer.sync(v, block=False)`` runs the lockstep gathers in the caller's thread (they are collectives with
the other trainer ranks, which call ``sync`` at the same point of their loop) and keeps a private copy of
exactly the tensors its routed chunks read (the schedule's ``keep`` sets). Serving then replays that copy in
the background. The memory cost is stated up front: ``Snapshot.cost(schedule, nbytes)`` bytes, i.e. the full
tensors routed to this rank, refused when above ``gather_budget_bytes``.

    pending = producer.sync(version, block=False)   # returns once the snapshot is taken
    ...                                             # optimizer steps may change the weights now
    pending.result()                                # or the next producer.sync(...) waits for it
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

from .lockstep_batches import next_batch, no_more_batches
from ...errors import SyncError, TransportError

__all__ = ["Snapshot", "PendingSync"]


class Snapshot:
    """The source's batches as this rank will serve them, taken now (a copy of the kept tensors only)."""

    def __init__(self, source: Any, schedule: Any, metas: list[Any], *, version: int, rank: int,
                 budget_bytes: int | None):
        ls = schedule
        cost = self.cost(ls, {m.name: m.nbytes for m in metas})
        if budget_bytes is not None and cost > budget_bytes:
            raise SyncError(f"producer {rank}: a non-blocking sync of version {version} must keep "
                            f"{cost} bytes of full tensors aside, above gather_budget_bytes={budget_bytes}; sync with "
                            "block=True or raise the budget")
        it = iter(source.iter_groups())
        self.batches: list[tuple[list[str], list[Any]]] = []
        self.nbytes = 0
        for b, expect in enumerate(ls.batches):
            names, tensors = next_batch(it, expect, b, rank=rank, n_batches=len(ls.batches))
            kept = [t.detach().clone() if n in ls.keep[b] and t is not None else None for n, t in zip(names, tensors)]
            self.nbytes += sum(t.numel() * t.element_size() for t in kept if t is not None)
            self.batches.append((names, kept))
        no_more_batches(it, rank=rank, n_batches=len(ls.batches))

    @staticmethod
    def cost(schedule: Any, nbytes: dict[str, int]) -> int:
        """Bytes a snapshot keeps: every tensor this rank's routed chunks read."""
        return sum(nbytes[n] for keep in schedule.keep for n in keep)

    def iter_groups(self) -> Iterator[tuple[list[str], list[Any]]]:
        yield from self.batches


class PendingSync:
    """A non-blocking sync being served in the background (``start`` runs it; it ends with ``finish``)."""

    def __init__(self, version: int):
        self.version = version
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._out: dict[str, Any] | None = None
        self._err: BaseException | None = None

    def start(self, serve: Callable[[], None]) -> None:
        """Run ``serve`` in a background thread; it must end by calling :meth:`finish`."""
        self._thread = threading.Thread(target=serve, name=f"shardsync-serve-v{self.version}", daemon=True)
        self._thread.start()

    def finish(self, out: dict[str, Any] | None = None, *, error: BaseException | None = None) -> None:
        """The sync's outcome (as ``sync`` returns it), or its failure."""
        self._out, self._err = out, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The version's outcome (as ``sync`` returns it), or its failure raised; waits up to ``timeout_s``."""
        if not self._done.wait(timeout_s):
            raise TransportError(f"non-blocking sync of version {self.version} still serving after {timeout_s} s")
        if self._err is not None:
            raise self._err
        assert self._out is not None
        return self._out
