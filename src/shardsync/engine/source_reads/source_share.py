"""Source reads, the producer's side: a group served where the trainer's tensors lie, not packed into the ring.

A consumer on the producer's GPU (``cuda_ipc``) or in its process (``loopback``) maps the storages of the trainer's
full tensors once and scatters straight from them into its parameters (``engine/source_reads/source_open.py``): one memory pass
instead of two (the ring's pack pass is gone) and no ring slot. A group is served so only when

1. every tensor its units read is the source's own object, yielded by a gather batch that held the same objects last
   sync (``SameBatches``: a live parameter, not a fresh all-gather), and
2. no other batch's tensors overlap that memory (a source gathering every batch into one reused buffer would overwrite
   a group its consumers still read: those batches are packed), and
3. the transport can share memory and nothing needs the packed bytes (no checksums, keyed tags or deltas).

The producer holds the group's tensors until every consumer released it, and a blocking ``sync`` holds the trainer: no
one writes them meanwhile. A storage is exported once (its descriptor cached while the tensor lives); a group's table
is encoded once and re-sent as the same bytes while its batches stay the same::

    share = SourceShare(transport, rank=0)
    blob = share.table("model.layers.3", names, kept, same_batches, schedule, hits)   # Ready.sources, or None: pack
"""

from __future__ import annotations

import weakref
from typing import Any

import msgspec
import torch

from ..protocol import messages as m
from ...errors import SyncError, TransportError

__all__ = ["SourceShare"]


class SourceShare:
    def __init__(self, transport: Any, *, rank: int):
        self.transport, self.rank = transport, rank
        self._descs: dict[int, tuple[Any, dict[str, Any]]] = {}
        """Storage address -> (weak reference to a tensor on it, its transport descriptor)."""
        self._tables: dict[str, tuple[tuple, bytes | None]] = {}
        """Group -> (the record serials of its batches, its encoded table; None: it cannot be served so)."""
        self._batch_of: tuple[Any, dict[str, int]] = (None, {})
        self._bad: tuple[int, frozenset[int]] = (-1, frozenset())
        self._group_batches: dict[str, list[int]] = {}
        self.served = 0
        """Groups served by their source tensors (summed over syncs)."""

    @classmethod
    def configured(cls, cfg: Any, transport: Any, *, gpu: bool, checksums: bool) -> "SourceShare | None":
        """The producer's source reads per ``ProducerConfig.source_reads`` (None: on for a GPU ring, where they can
        be); SyncError when asked for where they cannot be."""
        can = transport.caps.shares_memory and not (checksums or cfg.mac or cfg.delta)
        if cfg.source_reads and not can:
            raise SyncError(f"producer {cfg.rank}: source_reads needs a transport that shares memory (cuda_ipc, "
                            "loopback) and no checksums, mac or delta")
        on = cfg.source_reads if cfg.source_reads is not None else gpu
        return cls(transport, rank=cfg.rank) if can and on else None

    def table(self, group: str, names: list[str], kept: dict[str, torch.Tensor], same: Any, schedule: Any,
              hits: set[int]) -> bytes | None:
        """The encoded :class:`~shardsync.engine.protocol.messages.SourceTable` of ``group``'s tensors ``names`` (this
        rank's ``kept`` ones), or None when the group must be packed. ``hits``: the batches that held the same
        objects as last sync, this sync."""
        batches = self.batches_of(group, names, schedule)
        if not names or not hits.issuperset(batches):
            return None
        serials = tuple(same.spans[b][0] for b in batches)
        cached = self._tables.get(group)
        if cached is not None and cached[0] == serials:
            return cached[1]
        blob = None
        if not self.overlapping(same).intersection(batches):
            try:
                blob = self.encode(names, kept)
            except TransportError:
                blob = None  # a tensor the transport cannot share (another device): packed, as before
        self._tables[group] = (serials, blob)
        return blob

    def batches_of(self, group: str, names: list[str], schedule: Any) -> list[int]:
        """The gather batches ``names`` come from (once per group and schedule)."""
        if self._batch_of[0] is not schedule:
            self._batch_of = (schedule, {n: b for b, names in enumerate(schedule.batches) for n in names})
            self._tables.clear()
            self._group_batches.clear()
        got = self._group_batches.get(group)
        if got is None:
            bo = self._batch_of[1]
            got = self._group_batches[group] = sorted({bo[n] for n in names})
        return got

    def overlapping(self, same: Any) -> frozenset[int]:
        """Batches whose kept tensors' memory overlaps another batch's (recomputed when a batch is re-recorded)."""
        if self._bad[0] == same.serial:
            return self._bad[1]
        spans = sorted((p, p + n, b) for b, (_, sp) in same.spans.items() for p, n in sp if n)
        bad: set[int] = set()
        end, end_b = -1, -1
        for lo, hi, b in spans:
            if lo < end and b != end_b:
                bad.update((b, end_b))
            if hi > end:
                end, end_b = hi, b
        self._bad = (same.serial, frozenset(bad))
        return self._bad[1]

    def encode(self, names: list[str], kept: dict[str, torch.Tensor]) -> bytes:
        """The encoded :class:`~shardsync.engine.protocol.messages.SourceTable` of tensors ``names`` of ``kept``, as
        they lie (no check that they stay unchanged: the caller holds them, as for a copy it made)."""
        storages: list[dict[str, Any]] = []
        index: dict[int, int] = {}
        rows = []
        for n in names:
            t = kept[n]
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in index:
                index[ptr] = len(storages)
                storages.append(self._desc(t, ptr))
            rows.append((n, index[ptr], t.storage_offset() * t.element_size()))
        return msgspec.msgpack.encode(m.SourceTable(storages=storages, tensors=rows))

    def _desc(self, t: torch.Tensor, ptr: int) -> dict[str, Any]:
        got = self._descs.get(ptr)
        if got is not None:
            ref = got[0]()
            if ref is not None and ref.untyped_storage().data_ptr() == ptr:
                return got[1]
        desc = self.transport.share(t)
        if len(self._descs) > 1 << 16:  # bounded: forget storages whose tensors are gone
            self._descs = {k: v for k, v in self._descs.items() if v[0]() is not None}
        self._descs[ptr] = (weakref.ref(t), desc)
        return desc
