"""The lockstep loop's per-batch cache (issue 26: nothing per tensor on the hot path that the plan knows).

A source that yields the same tensor objects every sync (``ModuleSource`` over live parameters, a colocated
trainer's weights) gets each gather batch's checks done once: the names it keeps, their shapes and dtypes against the
metadata, contiguity. Later syncs check only that the batch holds the same objects (``plan.viewcache.SameTensors``: ids,
addresses, strides, element counts, weak references, at C speed) and take the kept tensors by position.
A source whose tensors are new every sync (an FSDP all-gather's output) never matches and costs one signature per
batch; nothing here keeps a tensor alive (weak references only)::

    same = SameBatches()
    hit = same.check(b, tensors)          # (gathered bytes, positions kept, names kept) or None
    same.record(b, tensors, now, positions, names)   # after the full checks passed
"""

from __future__ import annotations

from typing import Any

from ...plan.viewcache import SameTensors

__all__ = ["SameBatches"]


class SameBatches:
    def __init__(self) -> None:
        self.entries: dict[int, tuple[SameTensors, int, list[int], list[str]]] = {}
        self.hits = 0
        self.spans: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        """Batch -> (its record serial, [(address, bytes) of each kept tensor]): where the recorded batches' tensors
        lie (source reads check that no two batches share memory: ``engine/source_reads/source_share.py``)."""
        self.serial = 0
        """Bumped by every record."""
        self.generation = 0
        """Bumped by every miss: while it stays the same, every batch checked since holds the objects it held when
        first checked (the packers' view caches trust their views for it: ``GroupPacker.pack(gen=)``)."""

    def reset(self) -> None:
        """A new schedule (its batches are other lists): forget every batch; the generation only ever grows."""
        self.entries.clear()
        self.spans.clear()
        self.generation += 1
        self.serial += 1

    def check(self, b: int, tensors: list[Any]) -> tuple[int, list[int], list[str]] | None:
        e = self.entries.get(b)
        if e is None:
            self.generation += 1
            return None
        seen, now, idx, names = e
        if not seen.matches(tensors):
            del self.entries[b]
            self.spans.pop(b, None)
            self.serial += 1
            self.generation += 1
            return None
        self.hits += 1
        return now, idx, names

    def record(self, b: int, tensors: list[Any], now: int, idx: list[int], names: list[str]) -> None:
        """Batch ``b`` passed the full checks and every kept tensor is the source's own object (contiguous)."""
        self.entries[b] = (SameTensors(tensors), now, idx, names)
        self.serial += 1
        self.spans[b] = (self.serial, [(tensors[i].data_ptr(), tensors[i].nbytes) for i in idx])
