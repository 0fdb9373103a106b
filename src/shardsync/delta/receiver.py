"""Consumer side of delta sync (``Consumer(delta=True)``): a held copy of its chunks, patched by deltas.

:class:`HeldChunks` keeps the packed bytes of every chunk of the consumer's plan (one arena on its lane's device:
``stats["delta_held_bytes"]``, the plan's packed size) and, per chunk, the version they are. Per chunk of a
``Ready`` (:func:`read_held`; the engine's ``HeldSink`` in ``engine/consumer/chunksinks.py`` calls it with its
transport read and its puller's checks, so this module needs no engine):

- the producer offers a delta (``Ready.deltas``, ``sender.py``) whose base is the version held: read only the
  payload into a staging buffer (one per producer, the largest chunk: ``delta_staging_bytes``), decode it into
  the held copy (validated before a byte is written) and check the producer's xxh3 of the new dense bytes (and
  the chunk's own checksum or keyed tag, where it came). A failure there — a malformed entry, a bad payload, a
  checksum mismatch — reads the dense bytes instead, in the same sync (``delta_heals``);
- else (first sync, restarted, rejoined after a missed version, torn, no delta offered): read the dense bytes
  into the held copy (``delta_dense_chunks``).

The group is then applied from the held copy (a :class:`~shardsync.plan.pack.ChunkParts`; no direct reads).

**Live chunks.** Where the engine's parameters hold a chunk's bytes as they were written (a layer written directly,
each scatter's region its own: ``plan/readback.py``; ``Consumer(read_back=)``), the chunk is not held here at all
(``delta_live_bytes``, not in ``delta_held_bytes``): each sync it lands in the group's receive slot, and a delta's
base is first packed again from the parameters there. That base is hashed whole for each delta's check (a
group's together; the parameters are the engine's: a stored hash could not tell a change it did not make), which
then runs before writing, as for a held chunk.

Every chunk written in a sync is unversioned until the sync completes (:meth:`HeldChunks.commit`); a failed sync
leaves them unversioned (:meth:`HeldChunks.fail`): their next read is dense.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch

from .sender import CODE_KIND, ENTRY_LEN
from . import codec
from ..errors import ChecksumError, DeltaError, SyncError
from ..kernels import word_delta
from ..kernels.word_hash import word_hash_many
from ..plan.pack import ALIGN, ChunkParts, GroupLayout

__all__ = ["HeldChunks", "read_held", "parse_offers"]

Fetch = Callable[..., None]
"""``fetch(offset, nbytes, dst, payload=False)``: ``nbytes`` of the producer's buffer at ``offset`` into ``dst``."""
Verify = Callable[..., None]
"""``verify(data, checksum, tag, group, chunk, hashed=None)``: raises ChecksumError (or ChunkMacError) for bytes
that are not the producer's."""


class HeldChunks:
    """The consumer's chunks at the versions it completed (see the module docstring)."""

    def __init__(self, layouts: dict[str, GroupLayout], *, device: torch.device, read_back: Any = None):
        self.layouts, self.device = layouts, device
        self.read_back = read_back
        """The engine's parameters as the base of the chunks they hold (``plan/readback.ParamsReadBack``: its
        ``readable`` scatters and ``read_back(group, chunk, dst)``), or None: every chunk is held here."""
        readable = getattr(read_back, "readable", None) or {}
        self.live: frozenset[tuple[str, int]] = frozenset(
            (g, c.index) for g, lay in layouts.items() for c in lay.chunks
            if c.stop > c.first and all(i in readable.get(g, ()) for i in range(c.first, c.stop)))
        """Chunks not held here: each sync lands them in a receive slot, a delta's base read back from the
        parameters first (``read_back``)."""
        self.offsets: dict[tuple[str, int], tuple[int, int]] = {}
        self.sizes: dict[tuple[str, int], int] = {}
        need = 0
        for g, lay in layouts.items():
            for c in lay.chunks:
                self.sizes[(g, c.index)] = c.nbytes
                if (g, c.index) in self.live:
                    continue
                self.offsets[(g, c.index)] = (need, c.nbytes)
                need += (c.nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.arena = torch.zeros(need, dtype=torch.uint8, device=device)
        self.largest = max(self.sizes.values(), default=0)
        self.versions: dict[tuple[str, int], int | None] = dict.fromkeys(self.sizes)
        self.hashes: dict[tuple[str, int], int | None] = dict.fromkeys(self.sizes)
        """The word hash of each chunk's held bytes where a delta's check established it: the next delta's check
        folds it (``codec.apply_verified``) instead of hashing the chunk. Never for a live chunk: the parameters
        are not this object's, so their bytes are hashed each time."""
        self._staging: dict[int, torch.Tensor] = {}
        self._staging_used: dict[int, Any] = {}  # producer -> CUDA event after the last work reading its staging
        self._touched: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("delta_chunks", "delta_dense_chunks", "delta_heals", "delta_rejected",
                                     "delta_payload_bytes", "delta_dense_bytes"), 0)

    @staticmethod
    def warm(device: torch.device) -> bool:
        """Compile and check the delta checks' kernels on ``device`` now (at init: the first delta sync then waits for
        none); whether they are used there."""
        return word_delta.warm(device)

    def view(self, group: str, ci: int) -> torch.Tensor:
        """A held chunk's bytes (not a live one's: those land where the sink puts them)."""
        off, n = self.offsets[(group, ci)]
        return self.arena[off: off + n]

    def is_live(self, group: str, ci: int) -> bool:
        return (group, ci) in self.live

    def base(self, group: str, ci: int, dst: torch.Tensor) -> None:
        """A live chunk's delta base, the bytes the parameters hold, packed into ``dst`` (on the current stream)."""
        self.read_back.read_back(group, self.layouts[group].chunks[ci], dst)

    def parts(self, group: str) -> ChunkParts:
        """What ``apply`` gets for ``group``: each chunk's held bytes."""
        return ChunkParts([(c, self.view(group, c.index)) for c in self.layouts[group].chunks])

    def staging(self, p: int) -> torch.Tensor:
        """Producer ``p``'s staging buffer, once the work queued on the last payload read into it has run (a
        transport copies on its own stream: the next payload must not land under a decode still queued)."""
        with self._lock:
            s = self._staging.get(p)
            if s is None:
                s = self._staging[p] = torch.empty(self.largest, dtype=torch.uint8, device=self.device)
        self.settle(p)
        return s

    def settle(self, p: int) -> None:
        """Wait for the work queued on producer ``p``'s staging buffer (the held bytes it writes are then there for
        an apply on another stream)."""
        with self._lock:
            ev = self._staging_used.pop(p, None)
        if ev is not None:
            ev.synchronize()

    def staged(self, p: int) -> None:
        """The work reading producer ``p``'s staging buffer is queued (on this thread's current stream)."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            with self._lock:
                self._staging_used[p] = ev

    def begin(self) -> None:
        self._touched = set()
        for k in self.counts:
            self.counts[k] = 0

    def touch(self, group: str, ci: int) -> tuple[int | None, int | None]:
        """The chunk is about to be written in this sync: returns the version it held and its word hash (None where
        not known); unversioned and unhashed until the write says otherwise (``written``) and the sync commits."""
        with self._lock:
            self._touched.add((group, ci))
            h, self.hashes[(group, ci)] = self.hashes[(group, ci)], None
            return self.versions[(group, ci)], h

    def written(self, group: str, ci: int, word_hash: int | None) -> None:
        """The chunk's bytes were written and checked: ``word_hash`` is their word hash (None: not known)."""
        with self._lock:
            self.hashes[(group, ci)] = None if (group, ci) in self.live else word_hash

    def count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v

    def commit(self, version: int) -> None:
        for k in self._touched:
            self.versions[k] = version
        self._touched = set()

    def fail(self) -> None:
        for k in self._touched:
            self.versions[k] = self.hashes[k] = None
        self._touched = set()

    def stats(self) -> dict[str, Any]:
        return dict(self.counts, delta_held_bytes=self.arena.numel(), delta_live_chunks=len(self.live),
                    delta_live_bytes=sum(self.sizes[k] for k in self.live),
                    delta_staging_bytes=sum(s.numel() for s in self._staging.values()))


def parse_offers(ready: Any, lay: GroupLayout, *, where: str) -> tuple[dict[int, tuple[int, codec.DeltaHeader]], int]:
    """``Ready.deltas`` checked against the announced chunks and this consumer's layout: chunk index -> (offset,
    header). Entries that are malformed are dropped (those chunks are read dense; returned as the second value);
    more entries than chunks, a chunk not announced or offered twice is a protocol error."""
    announced = {x[0] for x in ready.chunks}
    if len(ready.deltas) > len(ready.chunks):
        raise SyncError(f"{where}: {len(ready.deltas)} delta entries for {len(ready.chunks)} chunks")
    out: dict[int, tuple[int, codec.DeltaHeader]] = {}
    rejected = 0
    for e in ready.deltas:
        if len(e) != ENTRY_LEN or e[0] not in announced or e[0] in out:
            raise SyncError(f"{where}: delta entry {e[:ENTRY_LEN]!r} is not [chunk, offset, kind, count, base, "
                            f"checksum, hash] of an announced chunk offered once")
        ci, off, kind, count, base, csum, algo = e
        try:
            if kind not in CODE_KIND or off < 0:
                raise DeltaError(f"{where}: delta entry of chunk {ci}: kind {kind} / offset {off}")
            h = codec.DeltaHeader(kind=CODE_KIND[kind], nbytes=lay.chunks[ci].nbytes, count=count, base=base,
                                  checksum=csum, hash=algo)
            codec.check_header(h, nbytes=lay.chunks[ci].nbytes, where=f"{where}, chunk {ci}")
            if h.checksum is None:
                raise DeltaError(f"{where}: delta of chunk {ci} without a checksum")
        except DeltaError:
            rejected += 1
            continue
        out[ci] = (off, h)
    return out, rejected


def read_held(held: HeldChunks, p: int, ready: Any, announced: Iterable[tuple[int, Any, int, int, int, bytes | None]],
              *, fetch: Fetch, verify: Verify, where: str, place: Callable[[int], torch.Tensor] | None = None) -> int:
    """Producer ``p``'s chunks of ``ready.group`` into the held copy, each as a delta where one applies to the
    version held, else dense; returns the bytes read (the wire bytes).

    The group's deltas go together: their payloads into the staging buffer one after the other (payloads the
    producer placed side by side in one read), then every check queued before one host sync
    (``codec.apply_verified_many``) — as many at a time as the staging buffer holds.

    ``announced``: the reader's checked chunks of ``ready`` (index, layout entry, offset, bytes, checksum, tag);
    ``fetch(offset, nbytes, dst, payload=False)``: read bytes of producer ``p``'s buffer (its errors are the reader's
    to type; with ``payload``, a delta's: a ``DeltaError`` where it cannot be read, healed with the dense bytes);
    ``verify(data, checksum, tag, group, chunk[, hashed=])``: the chunk's own checksum or keyed tag (ChecksumError);
    ``where``: who reads what, for errors; ``place(chunk index)``: where a live chunk (``HeldChunks.live``) lands
    this sync — its delta's base is read back from the parameters there first."""
    group = ready.group
    offers, rejected = parse_offers(ready, held.layouts[group], where=where)
    held.count(delta_rejected=rejected, delta_heals=rejected)
    got = 0
    deltas: list[_Delta] = []
    dense: list[tuple] = []
    bases: list[int] = []  # the deltas of live chunks whose base was read back
    for ci, _, off, n, checksum, tag in announced:
        live = held.is_live(group, ci)
        if live and place is None:
            raise SyncError(f"{where}: chunk {ci} is not held here and its reader gave no place for it")
        row = (ci, off, n, checksum, tag, place(ci) if live else held.view(group, ci))
        have, have_hash = held.touch(group, ci)
        offer = offers.get(ci)
        if offer is not None and have is not None and offer[1].base == have:
            if live:
                held.base(group, ci, row[5])
                if offer[1].hash == codec.WORD:
                    bases.append(len(deltas))
            deltas.append(_Delta(row, have, have_hash, offer[0], offer[1],
                                 codec.payload_nbytes(offer[1].kind, n, offer[1].count)))
        else:
            dense.append(row)
    # the bases just read back, hashed together (one host sync): their checks then run before writing, as folded
    for i, h in zip(bases, word_hash_many([deltas[i].row[5] for i in bases])):
        deltas[i] = deltas[i]._replace(have_hash=h)
    for runs in _batches(deltas, held.largest):
        got += sum(d.size for run in runs for d in run[2])
        dense += _apply_deltas(held, p, group, runs, fetch, verify, where)
    for ci, off, n, checksum, tag, dst in dense:
        fetch(off, n, dst)
        verify(dst, checksum, tag, group, ci)
        held.count(delta_dense_chunks=1, delta_dense_bytes=n)
        got += n
    held.settle(p)  # the deltas' writes have landed before the group is applied (on the applier's stream)
    return got


class _Delta(NamedTuple):
    row: tuple
    """(chunk index, dense offset, bytes, checksum, tag, held bytes): what a dense read of it takes."""
    have: int
    have_hash: int | None
    offset: int
    header: codec.DeltaHeader
    size: int
    """The payload's bytes."""


Run = tuple[int, int, list]
"""(producer offset, staging offset, the deltas whose payloads it holds: side by side at the producer)."""


def _batches(deltas: list[_Delta], room: int) -> Iterator[list[Run]]:
    """The deltas in batches whose payloads fit the ``room`` bytes of a staging buffer together (a payload is never
    larger than its chunk, the buffer the largest chunk): each batch a list of runs, one read each — payloads the
    producer placed one after the other (less than ``ALIGN`` apart) share a run."""
    runs: list[Run] = []
    end = 0  # staging bytes the batch uses
    for d in deltas:
        if runs:
            off, at, ds = runs[-1]
            last = ds[-1]
            gap = d.offset - (last.offset + last.size)
            if 0 <= gap < ALIGN and at + d.offset + d.size - off <= room:
                ds.append(d)
                end = at + d.offset + d.size - off
                continue
        start = (end + ALIGN - 1) // ALIGN * ALIGN
        if runs and start + d.size > room:
            yield runs
            runs, start = [], 0
        runs.append((d.offset, start, [d]))
        end = start + d.size
    if runs:
        yield runs


def _apply_deltas(held: HeldChunks, p: int, group: str, runs: list[Run], fetch: Fetch, verify: Verify,
                  where: str) -> list[tuple]:
    """One batch: its payloads read into producer ``p``'s staging buffer, checked together and applied to the held
    copy (each validated, the held bytes hashing to the producer's checksum, before a byte is written where the
    fold applies). Returns the rows of the chunks to read dense instead (``delta_heals``)."""
    stage = held.staging(p)
    heal: list[tuple] = []
    items, taken = [], []
    for off, at, ds in runs:
        span = ds[-1].offset + ds[-1].size - off
        try:
            if span:
                fetch(off, span, stage[at: at + span], payload=True)  # a DeltaError where the offer cannot be read
        except DeltaError:
            heal += [d.row for d in ds]
            continue
        for d in ds:
            pos = at + d.offset - off
            items.append((d.row[5], codec.Encoded(d.header, stage[pos: pos + d.size]), d.have, d.have_hash,
                          f"{where}, chunk {d.row[0]}"))
            taken.append(d)
    try:
        results = codec.apply_verified_many(items)
    finally:
        held.staged(p)
    for d, res in zip(taken, results):
        ci, _, _, checksum, tag, dst = d.row
        try:
            if isinstance(res, DeltaError):
                raise res
            # its own checksum / keyed tag (the xxh3 just computed is not computed twice)
            verify(dst, checksum, tag, group, ci, hashed=res if d.header.hash == codec.XXH3 else None)
        except (DeltaError, ChecksumError):  # not the producer's bytes: self-heal with the dense ones
            heal.append(d.row)
            continue
        held.written(group, ci, res if d.header.hash == codec.WORD else None)
        held.count(delta_chunks=1, delta_payload_bytes=d.size)
    held.count(delta_heals=len(heal))
    return heal
