"""Iterating a source's gather batches in lockstep (``engine/schedule.py`` rule 1): each batch checked against the
schedule's, none left over, and — on failure — the rest still iterated so no peer rank waits in a collective.

Shared by one sync's loop (``producer_sync.py``), the non-blocking snapshot (``snapshot.py``), the producer's
failed begin (``producer.py``) and the vLLM trainer backend::

    names, tensors = next_batch(it, schedule.batches[b], b, rank=0, n_batches=len(schedule.batches))
    no_more_batches(it, rank=0, n_batches=len(schedule.batches))
    finish_lockstep(it)      # a failing rank: run the remaining collectives, ignoring what fails
"""

from __future__ import annotations

from typing import Any, Iterator

from ...errors import MetadataMismatch

__all__ = ["next_batch", "no_more_batches", "finish_lockstep"]


def next_batch(it: Iterator[Any], expect: list[str], b: int, *, rank: int,
               n_batches: int) -> tuple[list[str], list[Any]]:
    """Batch ``b`` of the source (its names must be ``expect``): iteration must follow ``groups()``."""
    try:
        names, tensors = next(it)
    except StopIteration:
        raise MetadataMismatch(f"producer {rank}: the source stopped after {b} gather groups; its "
                               f"groups() lists {n_batches}") from None
    if list(names) != expect:
        raise MetadataMismatch(f"producer {rank}: gather group {b} of the source is {list(names)[:3]}..., "
                               f"groups() said {expect[:3]}... (iteration must follow groups())")
    return list(names), list(tensors)


def no_more_batches(it: Iterator[Any], *, rank: int, n_batches: int) -> None:
    if next(it, None) is not None:
        raise MetadataMismatch(f"producer {rank}: the source yielded more gather groups than its "
                               f"groups() lists ({n_batches})")


def finish_lockstep(it: Iterator[Any]) -> None:
    """Run what is left of a source's batch iterator (every remaining collective), ignoring what fails: the rank is
    failing anyway; this only keeps its peers from waiting in a gather for it."""
    try:
        for _ in it:
            pass
    except Exception:  # noqa: BLE001 - the original failure is the one raised
        pass
