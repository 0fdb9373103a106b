"""Producer side of delta sync (``ProducerConfig.delta``): encode each packed chunk against the bytes last served.

A :class:`DeltaSender` wraps a :class:`~shardsync.delta.DeltaHistory` over this rank's units (key: route key,
group, chunk index), built on the ring's device at ``_assign`` (again after a plan change: the bases are then
gone and the next version goes dense). Each ring slot holds the dense bytes at ``unit.slot_offset`` as before, then
a **delta area** (:func:`area_bytes`: a quarter of them at first): the slot's payloads are placed one after the
other, and a chunk whose payload does not fit in what is left goes dense (``delta_too_large``). The area is then
**sized by the changed fraction seen** (:meth:`DeltaSender.area_for`, at the next version's start; the producer swaps
its ring on the same transport): twice the most bytes one slot's deltas needed in the last completed version (those
that went dense for lack of room counted), at least 1/64 of the dense bytes and at most half; it grows at once when
something did not fit and shrinks when it is over four times what was needed; no area after a version in which no
member read a delta (a colocated engine reading in place), a quarter again after one in which a member did.

Memory: the history (every served chunk once, ``delta_budget_bytes``; default exactly that: no undo journal, so a
failed version's encoded chunks have no base next version and go dense once; a budget beyond the chunks buys a
journal of up to as much again, which restores their bases instead; allocated at the first chunk some member may
read as a delta) and the delta areas (``delta_area_bytes`` a slot; ``delta_area_need_bytes``: what the version's
deltas needed of one).

Per version (``ProducerSync``): ``begin`` before the first pack; after a group is packed (on the publisher, after
the pack's event: its host syncs are not on the serving thread) :meth:`offer` encodes its chunks together and,
where the history held a base and a delta is smaller than dense, writes each payload into the delta area and
returns the wire entry for ``Ready.deltas``; ``commit`` when the version completed, ``rollback`` when it failed (a
failed version never becomes a base). The dense bytes stay in the ring: each consumer chooses (``receiver.py``).

Wire entry (``Ready.deltas``, one per chunk offered as a delta, at most one per announced chunk)::

    [chunk index, offset in the registered buffer, kind (1 pairs, 2 bitmap), count, base version, checksum, hash]

``hash``: ``codec.XXH3`` (a host ring) or ``codec.WORD`` (a GPU ring: ``kernels/word_hash.py``, no host copy).
"""

from __future__ import annotations

from typing import Any

import torch

from . import codec
from .history import DeltaHistory
from ..errors import DeltaBudgetError
from ..kernels import word_delta

__all__ = ["DeltaSender", "KIND_CODE", "CODE_KIND", "ENTRY_LEN"]

KIND_CODE = {codec.PAIRS: 1, codec.BITMAP: 2}
CODE_KIND = {v: k for k, v in KIND_CODE.items()}
ENTRY_LEN = 7
AREA_SHARE = 4
"""A slot's first delta area is a quarter of its dense bytes: room for pairs up to ~8 % of a bf16 chunk's words
changed (a bitmap up to ~19 %), summed over the slot's chunks; more goes dense."""
AREA_MIN_SHARE, AREA_MAX_SHARE = 64, 2
"""A sized area is at least 1/64 of the dense bytes (while some member reads deltas) and at most half of them (a
payload above half saves less than half the bytes)."""
AREA_HEADROOM = 2
"""A sized area holds this many times what the last version's deltas needed of one slot."""


class DeltaSender:
    """This rank's delta history and per-version counters (see the module docstring)."""

    def __init__(self, units: dict[str, list[Any]], *, device: torch.device, budget_bytes: int | None,
                 host: bool = False):
        self.sizes = {(u.digest, g, u.chunk.index): u.chunk.nbytes for g, us in units.items() for u in us}
        need = sum(codec_align(n) for n in self.sizes.values())
        self.budget = need if budget_bytes is None else budget_bytes  # default: the bases once, no undo journal
        if self.budget < need:
            raise DeltaBudgetError(budget=self.budget, need=need)  # refused at init, not at the first encode
        if device.type == "cuda":  # the encode runs where the chunks lie: its kernels compiled now, not in a sync
            word_delta.warm(device)
        self.device, self.pin = (torch.device("cpu"), True) if host else (device, False)
        """Where the history lives: the ring's device, or (``host``) pinned host memory beside a GPU ring."""
        self._history: DeltaHistory | None = None
        self._open: int | None = None
        self.offered = self.dense = self.skipped = self.too_large = 0
        self.payload_bytes = 0
        self.area = 0
        """Bytes of each ring slot's delta area (the producer sets it when it allocates the ring)."""
        self.area_need = 0
        """This version's: the most bytes one slot's deltas needed (those that went dense for lack of room too)."""
        self.with_base = 0
        """This version's chunks encoded against a base (offered, or dense by size or for lack of room)."""
        self._seen: tuple[int, bool, bool] | None = None
        """The last completed version's (area need, encoded against bases, some member read deltas), until
        :meth:`area_for` acted on it."""

    @property
    def history(self) -> DeltaHistory:
        """The bases, allocated at the first chunk some member may read as a delta, freed after a version in which
        every member read dense (a colocated engine mapping the ring)."""
        if self._history is None:
            self._history = DeltaHistory(self.sizes, budget_bytes=self.budget, device=self.device,
                                         pin_memory=self.pin)
            if self._open is not None:
                self._history.begin(self._open)
        return self._history

    def stats(self) -> dict[str, Any]:
        h = self._history
        return {"delta_history_bytes": 0 if h is None else h.need + h.journal_bytes, "delta_budget_bytes": self.budget,
                "delta_history_device": str(self.device) + (" (pinned)" if h is not None and h.pinned else ""),
                "delta_offered": self.offered, "delta_dense": self.dense, "delta_skipped": self.skipped,
                "delta_too_large": self.too_large,
                "delta_payload_bytes": self.payload_bytes, "delta_area_bytes": self.area,
                "delta_area_need_bytes": self.area_need}

    def begin(self, version: int) -> None:
        self.offered = self.dense = self.skipped = self.too_large = self.payload_bytes = 0
        self.area_need = self.with_base = 0
        self._open = version
        if self._history is not None:
            self._history.rollback()  # nothing should be open; a version left open by a crash never becomes a base
            self._history.begin(version)

    def commit(self, version: int) -> None:
        self._open = None
        self._seen = (self.area_need, bool(self.with_base), bool(self.offered or self.dense))
        if self._history is not None:
            self._history.commit(version)
            if self.skipped and not (self.offered or self.dense):  # no member read a delta: the bases go
                self._history = None

    def rollback(self) -> None:
        self._open = None
        if self._history is not None:
            self._history.rollback()

    def area_for(self, dense_slot: int) -> int | None:
        """The delta area each slot should have from the next version on (bytes), or None to keep :attr:`area`:
        sized by the last completed version (see the module docstring). Each completed version is acted on once."""
        seen, self._seen = self._seen, None
        if seen is None:
            return None
        need, based, wanted = seen
        if not wanted:  # no member read a delta (colocated engines reading in place): no area
            want = 0
        elif not based:  # a first version (no bases yet) tells nothing of the fraction: a dropped area comes back
            return area_bytes(dense_slot) if not self.area else None
        else:
            want = min(codec_align(dense_slot // AREA_MAX_SHARE),
                       max(codec_align(dense_slot // AREA_MIN_SHARE), codec_align(AREA_HEADROOM * need)))
        if (need > self.area and want > self.area) or want * AREA_HEADROOM < self.area:
            return want
        return None

    def skip(self, unit: Any, group: str) -> None:
        """Every live member reads the unit's chunk dense this version: it is not encoded, and its base (now
        stale) is dropped."""
        self.skipped += 1
        if self._history is not None:
            self._history.invalidate([(unit.digest, group, unit.chunk.index)])

    def offer(self, group: str, chunks: list[tuple[Any, torch.Tensor, int | None]], area: torch.Tensor,
              offset: int) -> list[list[int] | None]:
        """Encode a group's packed chunks — ``(unit, region, known_checksum)`` each — against the history, together
        (on a GPU one host sync for all their change counts and one for their payloads, not two per chunk). The
        deltas' payloads go one after the other into ``area`` (the slot's delta area, at ``offset`` in the registered
        buffer). Returns per chunk its ``Ready.deltas`` entry, or None (no base, dense is no larger, or the payload
        does not fit in what is left of ``area``): consumers then read the dense bytes. ``known_checksum``: the
        region's xxh3-64 where the caller computed it for the chunk (hashed once, not twice; on a GPU the word hash
        is computed instead, where the chunk lies)."""
        hist = self.history
        items, bases = [], []
        for unit, region, known in chunks:
            key = (unit.digest, group, unit.chunk.index)
            base = hist.version(key)
            reuse = known is not None and codec.hash_for(region) == codec.XXH3
            items.append((key, region, (known if reuse else True) if base is not None else False))
            bases.append(base)
        encs = hist.encode_many(items, area=area)
        out: list[list[int] | None] = []
        need = 0
        for (unit, region, _), base, (enc, at) in zip(chunks, bases, encs):
            h = enc.header
            kind = None  # the form the chunk's changes call for, where it had a base
            if base is not None and enc.changed is not None:
                self.with_base += 1
                kind = codec.choose(region.numel(), enc.changed)
                if kind != codec.DENSE:
                    need += codec_align(codec.payload_nbytes(kind, region.numel(), enc.changed))
            if h.kind == codec.DENSE:
                self.dense += 1
                self.too_large += kind not in (None, codec.DENSE)  # a delta with no room left in the area
                out.append(None)
                continue
            self.offered += 1
            self.payload_bytes += enc.payload.numel()
            assert h.base == base and h.checksum is not None and at is not None
            out.append([unit.chunk.index, offset + at, KIND_CODE[h.kind], h.count, h.base, h.checksum, h.hash])
        self.area_need = max(self.area_need, need)
        if area.is_cuda and any(e is not None for e in out):  # the payloads land before the Ready goes out
            torch.cuda.current_stream(area.device).synchronize()
        return out


def entry_payload_bytes(entry: list[int], nbytes: int) -> int:
    """Bytes of the payload a ``Ready.deltas`` entry announces for a chunk of ``nbytes`` (where the slot's next
    payload may start)."""
    return codec.payload_nbytes(CODE_KIND[entry[2]], nbytes, entry[3])


def area_bytes(dense_slot: int) -> int:
    """A ring slot's delta area beside ``dense_slot`` dense bytes: a share of them (a payload that does not fit in
    what is left of it goes dense)."""
    return codec_align(-(-dense_slot // AREA_SHARE)) if dense_slot else 0


def codec_align(n: int) -> int:
    from ..plan.pack import ALIGN

    return (n + ALIGN - 1) // ALIGN * ALIGN
