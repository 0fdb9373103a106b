"""Where a consumer's chunks land: one sink per producer it pulls from, chosen once when a sync's round starts
(:func:`choose_sink`), so that the puller and the round never ask which read path a producer takes.

Every sink has the same small interface (:class:`ChunkSink`):

* ``read(ready, check) -> nbytes``: read the producer's announced chunks of ``ready.group`` (``check`` is the
  puller: ``announced(ready)`` yields the checked chunks, ``verify`` checks each one's checksum or keyed tag);
* ``landed(group)``: the chunks it left outside the group's receive slot, [(chunk, bytes)], taken once by the
  applier (``PullRound.take``);
* ``holds_ring``: the apply reads the producer's memory where it lies, so its ``Released`` waits for the apply;
  else it goes out right after the read; ``wants_sources``: ask the producer for its tensors; ``takes_deltas``: tell
  it this sink reads its deltas (``WaitReady.deltas``); ``sourced``: groups served from the producer's tensors.

The read paths' sinks (:class:`PathSink`) also have ``place_sources(group, chunks, full, pack)``: where a source
read's mapped tensors go (left where they lie, or packed by ``pack`` into their destinations). The sinks:

* :class:`SlotSink`: into the group's receive slot (``recvslots.SlotPool``);
* :class:`DirectSink`: the producer's ring is mapped into this process on this consumer's device: check each
  chunk's range and bytes there, the apply copies straight from it (``direct_reads``);
* :class:`HeldSink`: delta sync, into the held copy, a delta where one applies (``delta/receiver.py``);
* ``SourceSink`` (``engine/source_reads/source_open.py``), around each of them: a ``Ready`` that names the
  producer's tensors is served from them (the producer decides that group by group, so it is the one choice made
  per ``Ready``; the others go to the read path's sink)::

    sink = choose_sink(ctx, p, version, ring=direct.get(p), slots=pool, held=None, opener=opener)
    got = sink.read(ready, puller)
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Protocol

import torch

from .pullcontext import PullContext
from .recvslots import SlotPool
from ..protocol import messages as m
from ..source_reads.source_open import SourceOpener, SourceSink
from ...delta.receiver import HeldChunks, read_held
from ...errors import ChecksumError, DeltaError, SyncError, TransportError
from ...plan.pack import Chunk, Sources

__all__ = ["ChunkCheck", "ChunkSink", "PathSink", "SlotSink", "DirectSink", "HeldSink", "choose_sink"]

Announced = Iterator[tuple[int, Chunk, int, int, int, "bytes | None"]]
Placed = list[tuple[Chunk, Any]]
Pack = Callable[[Placed], None]


class ChunkCheck(Protocol):
    """What a sink asks of its puller while it reads."""

    def announced(self, ready: m.Ready) -> Announced:
        """Each announced chunk: (index, layout entry, offset, bytes, checksum, tag), checked against the layout
        while the version stands and the producer lives."""
        ...

    def verify(self, data: Any, checksum: int, tag: bytes | None, group: str, chunk: int,
               hashed: int | None = None) -> None:
        ...


class ChunkSink(Protocol):
    """Where one producer's chunks land in one sync (the module docstring): what the puller and the round use."""

    holds_ring: bool
    wants_sources: bool
    takes_deltas: bool
    sourced: int

    def read(self, ready: m.Ready, check: ChunkCheck) -> int: ...

    def landed(self, group: str) -> Placed: ...


class PathSink(ChunkSink, Protocol):
    """A read path's sink (slot, direct, held): also says where a source read's mapped tensors go, for the
    ``SourceSink`` around it."""

    def place_sources(self, group: str, chunks: list[tuple[int, Chunk]], full: Sources, pack: Pack) -> None: ...


class _Landed:
    """Group -> the chunks a sink left outside the receive slot (written by its puller, taken by the applier)."""

    def __init__(self) -> None:
        self._parts: dict[str, Placed] = {}
        self._lock = threading.Lock()

    def add(self, group: str, parts: Placed) -> None:
        with self._lock:
            self._parts.setdefault(group, []).extend(parts)

    def pop(self, group: str) -> Placed:
        with self._lock:
            return self._parts.pop(group, [])


class SlotSink:
    """Producer ``p``'s chunks read into the group's receive slot; released right after the read."""

    holds_ring = False
    wants_sources = False
    takes_deltas = False
    sourced = 0

    def __init__(self, ctx: PullContext, p: int, version: int, slots: SlotPool):
        self.ctx, self.p, self.version, self.slots = ctx, p, version, slots

    def slot(self, group: str) -> torch.Tensor:
        return self.slots.acquire(group, what=f"group {group!r} of version {self.version}")

    def read(self, ready: m.Ready, check: ChunkCheck) -> int:
        ctx, p, group = self.ctx, self.p, ready.group
        buf = self.slot(group)
        got = 0
        for ci, chunk, off, n, checksum, tag in check.announced(ready):
            dst = buf[chunk.start: chunk.start + n]
            try:
                ctx.transport.read(p, off, n, dst, timeout_s=max(ctx.lease_s, n / 50e6))
            except TransportError as e:
                raise ctx.lost(p, self.version, group, e) from None
            check.verify(dst, checksum, tag, group, ci)
            got += n
        return got

    def landed(self, group: str) -> Placed:
        return []  # all in the slot

    def place_sources(self, group: str, chunks: list[tuple[int, Chunk]], full: Sources, pack: Pack) -> None:
        buf = self.slot(group)
        pack([(ch, buf[ch.start: ch.start + ch.nbytes]) for _, ch in chunks])


class DirectSink:
    """Producer ``p``'s ring, mapped into this process (``ring``): each chunk is checked where it lies and the apply
    copies from there; released once the group is applied."""

    holds_ring = True
    wants_sources = False
    takes_deltas = False
    sourced = 0

    def __init__(self, ctx: PullContext, p: int, version: int, ring: Any):
        self.ctx, self.p, self.version, self.ring = ctx, p, version, ring
        self.parts = _Landed()

    def read(self, ready: m.Ready, check: ChunkCheck) -> int:
        ctx, p, group, remote = self.ctx, self.p, ready.group, self.ring
        parts, got = [], 0
        for ci, chunk, off, n, checksum, tag in check.announced(ready):
            if off < 0 or off + n > remote.numel():
                raise SyncError(f"consumer {ctx.id}: producer {p} announced chunk {ci} of {group!r} at [{off}, "
                                f"{off + n}) of its {remote.numel()}-byte buffer; expected {chunk.nbytes} bytes inside")
            data = remote[off: off + n]
            check.verify(data, checksum, tag, group, ci)
            parts.append((chunk, data))
            got += n
        self.parts.add(group, parts)
        return got

    def landed(self, group: str) -> Placed:
        return self.parts.pop(group)

    def place_sources(self, group: str, chunks: list[tuple[int, Chunk]], full: Sources, pack: Pack) -> None:
        self.parts.add(group, [(ch, full) for _, ch in chunks])  # the apply scatters from the tensors themselves


class HeldSink:
    """Delta sync: producer ``p``'s chunks into the held copy (``delta/receiver.read_held``: a delta against the
    version held where the producer offers one, else the dense bytes); released right after the read. A live chunk
    (``HeldChunks.live``: its base is the engine's parameters) lands in the group's receive slot instead."""

    holds_ring = False
    wants_sources = False
    takes_deltas = True
    sourced = 0

    def __init__(self, ctx: PullContext, p: int, version: int, held: HeldChunks, slots: SlotPool | None = None):
        self.ctx, self.p, self.version, self.held, self.slots = ctx, p, version, held, slots
        self.parts = _Landed()

    def dst(self, group: str, ci: int) -> torch.Tensor:
        """Where chunk ``ci`` of ``group`` lands: the held copy, or (live) its place in the group's receive slot."""
        if not self.held.is_live(group, ci):
            return self.held.view(group, ci)
        if self.slots is None:
            raise SyncError(f"consumer {self.ctx.id}: chunk {ci} of {group!r} is read back from the parameters and "
                            "this sync has no receive slot for it")
        ch = self.ctx.layouts[group].chunks[ci]
        buf = self.slots.acquire(group, what=f"group {group!r} of version {self.version}")
        return buf[ch.start: ch.start + ch.nbytes]

    def read(self, ready: m.Ready, check: ChunkCheck) -> int:
        ctx, p, group = self.ctx, self.p, ready.group

        def fetch(off: int, n: int, dst: torch.Tensor, payload: bool = False) -> None:
            try:
                ctx.transport.read(p, off, n, dst, timeout_s=max(ctx.lease_s, n / 50e6))
            except TransportError as e:
                if isinstance(e, ChecksumError):
                    raise
                if payload:  # an offer that cannot be read (an offset past the buffer): heal with the dense bytes,
                    raise DeltaError(f"delta payload at [{off}, {off + n}) of producer {p}: {e}") from None  # whose
                raise ctx.lost(p, self.version, group, e) from None  # own read says whether the producer is lost

        got = read_held(self.held, p, ready, check.announced(ready), fetch=fetch, verify=check.verify,
                        where=f"consumer {ctx.id}: producer {p}, group {group!r}, version {self.version}",
                        place=lambda ci: self.dst(group, ci))
        self.note(group, [x[0] for x in ready.chunks])
        return got

    def note(self, group: str, indices: list[int]) -> None:
        chunks = self.ctx.layouts[group].chunks
        self.parts.add(group, [(chunks[ci], self.dst(group, ci)) for ci in indices])

    def landed(self, group: str) -> Placed:
        return self.parts.pop(group)

    def place_sources(self, group: str, chunks: list[tuple[int, Chunk]], full: Sources, pack: Pack) -> None:
        dsts = [(ch, self.dst(group, ci)) for ci, ch in chunks]  # the chunks' dense bytes into the held copy
        for ci, _ in chunks:
            self.held.touch(group, ci)
        pack(dsts)
        self.held.count(delta_dense_chunks=len(chunks), delta_dense_bytes=sum(ch.nbytes for _, ch in chunks))
        self.note(group, [ci for ci, _ in chunks])


def choose_sink(ctx: PullContext, p: int, version: int, *, ring: Any, slots: SlotPool | None,
                held: HeldChunks | None, opener: SourceOpener | None) -> SourceSink:
    """Producer ``p``'s sink for this sync: the held copy (``held``: a delta consumer reading ``p``'s deltas), else
    its mapped ring (``ring``: the consumer reads it directly), else a receive slot; wrapped for source reads."""
    inner: PathSink
    if held is not None:
        inner = HeldSink(ctx, p, version, held, slots)
    elif ring is not None:
        inner = DirectSink(ctx, p, version, ring)
    else:
        assert slots is not None, f"producer {p} is read through receive slots and this sync has none"
        inner = SlotSink(ctx, p, version, slots)
    return SourceSink(inner, opener, ctx, p)
