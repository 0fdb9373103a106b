"""Producer side of delta sync (``ProducerConfig.delta``): encode each packed chunk against the bytes last served.

A :class:`DeltaSender` wraps a :class:`~shardsync.delta.DeltaHistory` over this rank's units (key: route key,
group, chunk index), built on the ring's device at ``_assign`` (again after a plan change: the bases are then
gone and the next version goes dense). Each ring slot is twice the dense slot: the dense bytes at
``unit.slot_offset`` as before, and a **delta area** of the same size at ``dense_slot + unit.slot_offset`` (a
payload is never larger than its chunk). Memory: the history (every served chunk once, plus its undo journal,
together ``delta_budget_bytes``; default twice the chunks) and the delta areas (as much again as the dense ring).

Per version (``ProducerSync``): ``begin`` before the first pack; after a unit is packed (on the publisher, after
the pack's event: its one host sync per chunk is not on the serving thread) :meth:`offer` encodes it and, where the
history held a base and a delta is smaller than dense, writes the payload into the delta area and returns the wire
entry for ``Ready.deltas``; ``commit`` when the version completed, ``rollback`` when it failed (a failed version
never becomes a base). The dense bytes stay in the ring: each consumer chooses (``receiver.py``).

Wire entry (``Ready.deltas``, one per chunk offered as a delta, at most one per announced chunk)::

    [chunk index, offset in the registered buffer, kind (1 pairs, 2 bitmap), count, base version, xxh3-64]
"""

from __future__ import annotations

from typing import Any

import torch

from . import codec
from .history import DeltaHistory

__all__ = ["DeltaSender", "KIND_CODE", "CODE_KIND", "ENTRY_LEN"]

KIND_CODE = {codec.PAIRS: 1, codec.BITMAP: 2}
CODE_KIND = {v: k for k, v in KIND_CODE.items()}
ENTRY_LEN = 6


class DeltaSender:
    """This rank's delta history and per-version counters (see the module docstring)."""

    def __init__(self, units: dict[str, list[Any]], *, device: torch.device, budget_bytes: int | None):
        sizes = {(u.digest, g, u.chunk.index): u.chunk.nbytes for g, us in units.items() for u in us}
        need = sum(codec_align(n) for n in sizes.values())
        self.history = DeltaHistory(sizes, budget_bytes=2 * need if budget_bytes is None else budget_bytes,
                                    device=device)
        self.offered = self.dense = 0
        self.payload_bytes = 0

    def stats(self) -> dict[str, Any]:
        h = self.history
        return {"delta_history_bytes": h.need + h.journal_bytes, "delta_budget_bytes": h.budget,
                "delta_offered": self.offered, "delta_dense": self.dense, "delta_payload_bytes": self.payload_bytes}

    def begin(self, version: int) -> None:
        self.offered = self.dense = self.payload_bytes = 0
        self.history.rollback()  # nothing should be open; a version left open by a crash never becomes a base
        self.history.begin(version)

    def commit(self, version: int) -> None:
        self.history.commit(version)

    def rollback(self) -> None:
        self.history.rollback()

    def offer(self, unit: Any, group: str, region: torch.Tensor, area: torch.Tensor,
              offset: int, known_checksum: int | None = None) -> list[int] | None:
        """Encode ``region`` (the unit's packed chunk) against the history; a delta's payload goes to ``area``
        (the unit's delta area, at ``offset`` in the registered buffer). Returns the ``Ready.deltas`` entry, or
        None (no base, or dense is no larger): consumers then read the dense bytes. ``known_checksum``: the
        region's xxh3-64 where the caller computed it for the chunk (hashed once, not twice)."""
        key = (unit.digest, group, unit.chunk.index)
        base = self.history.version(key)
        want = (known_checksum if known_checksum is not None else True) if base is not None else False
        enc = self.history.encode(key, region, checksum=want, out=area if base is not None else None)
        h = enc.header
        if h.kind == codec.DENSE:
            self.dense += 1
            return None
        if area.is_cuda:  # the payload's writes must land before the Ready goes out (readers copy on their streams)
            torch.cuda.current_stream(area.device).synchronize()
        self.offered += 1
        self.payload_bytes += enc.payload.numel()
        assert h.base == base and h.checksum is not None
        return [unit.chunk.index, offset, KIND_CODE[h.kind], h.count, h.base, h.checksum]


def codec_align(n: int) -> int:
    from ..plan.pack import ALIGN

    return (n + ALIGN - 1) // ALIGN * ALIGN
