"""One sync of one producer: gather in lockstep, pack into the ring, announce, reclaim slots on release.

It follows ``engine/schedule.py``'s rules 1-7 (the lockstep schedule it replays is ``schedule.lockstep``),
then waits for the version's outcome (``producer.py``). It is given its collaborators explicitly
(``sync_context.SyncContext``: the config, the version table, the epoch's ring layout, the lane, the batch cache,
source reads, the fail / drain / outcome callbacks). Its counters are plain attributes and end up in the
producer's ``stats`` (``max_resident``, ``peak_gathered_bytes``, ``slot_wait_s``/``gather_s``/``pack_s``: host
time of the gather thread, by stage)::

    stats = ProducerSync(ctx, version, state, producer.source).run()
"""

from __future__ import annotations

import time
from collections import defaultdict
from itertools import repeat
from typing import Any, Iterator

import torch

from ..protocol import messages as m
from .lockstep_batches import finish_lockstep, next_batch, no_more_batches
from .publish import Publisher
from .sync_context import SyncContext
from .versions import VersionState
from ...security.chunkmac import chunk_tag
from ..protocol.wire import chunk_checksum
from ...errors import MetadataMismatch, ProducerLost, SyncError, TransportError
from ...source import check_tensor

__all__ = ["ProducerSync"]


class ProducerSync:
    """Serve ``version`` from ``source`` (the producer's own, or a snapshot of it) to the members of ``st``."""

    def __init__(self, ctx: SyncContext, version: int, st: VersionState, source: Any, *, snapshot_bytes: int = 0):
        self.ctx, self.version, self.st, self.source, self.snapshot_bytes = ctx, version, st, source, snapshot_bytes
        self.table, self.layout, self.cfg = ctx.table, ctx.layout, ctx.cfg
        self.free = list(range(ctx.layout.n_slots))
        """Ring slots not holding a packed, unreleased group."""
        self.slot_of: dict[str, int] = {}
        """Group -> the ring slot it is packed in (until every member released it)."""
        self.users: dict[str, set[str]] = defaultdict(set)
        """Plan digest -> the members that pull it."""
        for c, (d, _) in st.members.items():
            self.users[d].add(c)
        self.max_resident = 0
        """Most groups packed and unreleased at once (schedule rule 4: at most ``lookahead + 1``)."""
        self.sent = 0
        self.gathered = 0
        """Full-tensor bytes the source materialised on this rank."""
        self.peak = 0
        """Most full-tensor bytes resident at once (schedule rule 5)."""
        self.slot_wait_s = self.gather_s = self.pack_s = 0.0
        self.sources_held: dict[str, list[torch.Tensor]] = {}
        """Group -> the source tensors it is served from (source reads), until every member released it."""
        self.by_source: set[str] = set()
        """Groups served by their source tensors this sync (``engine/source_reads/source_share.py``)."""
        self.copied: set[str] = set()
        """Groups served from a copy of their tensors this sync (the ring released, ``RingLayout.released``)."""
        self.batches_reused = 0
        """Gather batches whose checks were skipped: the source yielded the same objects as last sync."""
        self._it: Iterator[Any] | None = None
        self.lockstep_done = False
        """Every batch of the source iterated (schedule rule 1: also on failure, see :meth:`finish_lockstep`)."""
        self.pub = Publisher(ctx.lane, timeout_s=ctx.cfg.timeout_s, who=f"producer {ctx.cfg.rank}")

    def run(self) -> dict[str, Any]:
        """Serve the version; with delta sync its history commits when the version completed and rolls back when
        it failed (``sender.py``), after the publisher stopped encoding."""
        delta = self.layout.delta
        if delta is None:
            return self._run()
        delta.begin(self.version)
        try:
            self._run()
        except BaseException:
            delta.rollback()
            raise
        delta.commit(self.version)
        self.ctx.stats.update(delta.stats())
        return dict(self.ctx.stats)

    def _run(self) -> dict[str, Any]:
        ctx, table, st, version, order = self.ctx, self.table, self.st, self.version, self.layout.order
        t0 = time.perf_counter()
        try:
            self._gather_and_pack()
        except BaseException as e:  # schedule rule 1: the version fails for all first, then the gathers still run
            ctx.fail(version, st, e)
            self.finish_lockstep()
            raise
        finally:
            self.pub.close()  # also when the sync fails: no publisher thread outlives it
        table.wait(lambda: all(not st.pending.get(g) for g in order),
                   lambda: f"every consumer to release version {version} (missing: "
                           f"{sorted({c for g in order for c in st.pending.get(g, ())})})", version, st)
        ctx.drain()
        table.finish(st)
        outcome = self.outcome()
        ctx.drain()  # the coordinator's replies to ``Completed`` too (rank 0)
        ctx.stats.update(version=version, seconds=time.perf_counter() - t0, bytes_sent=self.sent,
                         max_resident=self.max_resident, lookahead=self.cfg.lookahead, members=sorted(st.members),
                         gathered_bytes=self.gathered, peak_gathered_bytes=self.peak,
                         snapshot_bytes=self.snapshot_bytes,
                         source_stats=ctx.source_stats(),
                         completed=outcome.completed, dropped={**outcome.dropped, **st.dropped},
                         dropped_at=dict(st.dropped_at), slot_wait_s=self.slot_wait_s, gather_s=self.gather_s,
                         pack_s=self.pack_s, batches_reused=self.batches_reused, source_groups=len(self.by_source - self.copied),
                         copied_groups=len(self.copied))
        return dict(ctx.stats)

    def _gather_and_pack(self) -> None:
        ctx, lay, ls, rank = self.ctx, self.layout, self.layout.schedule, self.cfg.rank
        it = self._it = iter(self.source.iter_groups())
        kept: dict[str, torch.Tensor] = {}
        same = ctx.same_batches
        hits0 = same.hits
        dropped: list[torch.Tensor] = []  # held until a later pack has run (a queued pack may still read them)
        hits: set[int] = set()
        for b, expect in enumerate(ls.batches):
            t1 = time.perf_counter()
            if ls.pack_after[b] and ls.pack_after[b][0] not in lay.by_source:
                self.await_slot(ls.pack_after[b][0])  # rule 4: no gather while the ring is full
            t2 = time.perf_counter()
            names, tensors = next_batch(it, expect, b, rank=rank, n_batches=len(ls.batches))
            hit = same.check(b, tensors)
            if hit is not None:  # the same objects as last sync: its checks hold, take the kept ones by position
                now, idx, knames = hit
                hits.add(b)
                kept.update(zip(knames, map(tensors.__getitem__, idx)))
            else:
                now = self.check_batch(b, names, tensors, kept)
            self.gathered += now
            self.peak = max(self.peak, now + sum(kept[n].nbytes for n in kept.keys() - ls.keep[b]))  # + carried
            del tensors  # rule 2: the batch is dropped once looked at
            t3 = time.perf_counter()
            self.slot_wait_s += t2 - t1
            self.gather_s += t3 - t2
            for g in ls.pack_after[b]:
                blob = None if ctx.shares is None or not self.all_map(g) else \
                    ctx.shares.table(g, lay.unit_sources[g], kept, same, ls, hits)
                if blob is not None:  # source reads: announced where the tensors lie, no ring slot
                    self.sent += self.serve_sources(g, kept, blob, dropped)
                    dropped = []
                    continue
                self.await_slot(g)
                if lay.released:  # no ring: served from a copy of its tensors, which takes the slot's turn
                    t4 = time.perf_counter()
                    self.sent += self.serve_copy(g, kept, dropped)
                    dropped = []
                    self.pack_s += time.perf_counter() - t4
                    t3 = time.perf_counter()
                    continue
                t4 = time.perf_counter()
                self.max_resident = max(self.max_resident, len(self.slot_of) + 1)
                slot = self.free.pop(0)
                self.sent += self.pack(g, slot, kept, dropped)
                dropped = []
                self.slot_of[g] = slot
                self.slot_wait_s += t4 - t3
                self.pack_s += time.perf_counter() - t4
                t3 = time.perf_counter()
            gone = list(map(kept.pop, ls.drop_after[b], repeat(None)))  # at C speed
            if ctx.lane.cuda:
                dropped.extend(gone)
        self.lockstep_done = True
        self.batches_reused = same.hits - hits0
        lay.by_source = self.by_source - self.copied
        no_more_batches(it, rank=rank, n_batches=len(ls.batches))
        self.pub.submit(lambda: None, what="the last pack", hold=dropped)
        self.pub.flush()

    def check_batch(self, b: int, names: list[str], tensors: list[Any], kept: dict[str, torch.Tensor]) -> int:
        """The full checks of batch ``b`` (each kept tensor present, of the metadata's shape and dtype), its kept
        tensors into ``kept`` (contiguous); remembered for the next sync when every kept one is the source's own
        object. Returns the batch's bytes."""
        ctx, rank, keep = self.ctx, self.cfg.rank, self.layout.schedule.keep[b]
        now, idx, knames, own = 0, [], [], True
        for i, (n, t) in enumerate(zip(names, tensors)):
            if t is not None:
                now += t.nbytes
            if n in keep:
                if t is None:
                    raise MetadataMismatch(f"producer {rank}: the source yielded no tensor for {n!r}, which "
                                           "this rank holds and serves")
                shape, dt = ctx.expect[n]
                if t.shape != shape or t.dtype != dt:
                    check_tensor(next(x for x in ctx.metas if x.name == n), t, rank=rank)
                c = kept[n] = t.contiguous()
                own = own and c is t
                idx.append(i)
                knames.append(n)
        if own:
            ctx.same_batches.record(b, tensors, now, idx, knames)
        return now

    def finish_lockstep(self) -> None:
        """Schedule rule 1 on failure: iterate the batches not gathered yet (their collectives), keeping nothing."""
        if not self.lockstep_done:
            self.lockstep_done = True
            finish_lockstep(self._it if self._it is not None else iter(self.source.iter_groups()))

    def reclaim(self) -> bool:
        """Rule 7: a released group frees its slot. True when a slot is free."""
        self.pub.check()
        for g in [g for g in self.sources_held if not self.st.pending.get(g)]:
            del self.sources_held[g]
        for g, s in list(self.slot_of.items()):
            if not self.st.pending.get(g):
                self.free.append(s)
                del self.slot_of[g]
        return bool(self.free)

    def await_slot(self, g: str) -> None:
        st = self.st
        def what() -> str:
            waiting = sorted({c for gg in self.slot_of for c in st.pending.get(gg, ())})
            return f"a free ring slot for group {g!r} (held by {sorted(self.slot_of)}: consumers {waiting} have not " \
                   "released them)"

        self.table.wait(self.reclaim, what, self.version, st)

    def all_map(self, g: str) -> bool:
        """Every live member pulling group ``g`` maps this producer's memory on its device (``WaitReady.sources``)."""
        table, st = self.table, self.st
        with table.cv:
            users = set().union(*(self.users[u.digest] for u in self.layout.units[g])) - st.dropped.keys()
            return bool(users) and all(table.reads_sources.get(c) for c in users)

    def serve_sources(self, g: str, full: dict[str, torch.Tensor], blob: bytes, hold: list) -> int:
        """Announce group ``g`` where its source tensors lie (``Ready.sources``), once the stream that wrote them
        has run; they are held until every member released the group. Returns the bytes it will send."""
        ctx, table, st, units = self.ctx, self.table, self.st, self.layout.units[g]
        with table.cv:
            live = {d: cs - st.dropped.keys() for d, cs in self.users.items()}
            st.pending[g] = set().union(*(self.users[u.digest] for u in units)) - st.dropped.keys()
        self.sources_held[g] = list(map(full.__getitem__, self.layout.unit_sources[g]))
        self.by_source.add(g)
        ctx.shares.served += 1
        with ctx.lane:  # the lane waits for the stream that wrote the weights; the announcement waits for the lane
            pass

        def announce() -> None:
            ready: dict[str, m.Ready] = {}
            for u in units:
                r = ready.setdefault(u.digest, m.Ready(version=self.version, group=g, chunks=[], sources=blob))
                r.chunks.append([u.chunk.index, -1, u.chunk.nbytes, -1])
            table.announce(st, g, ready)

        self.pub.submit(announce, what=f"serving group {g!r} from its source tensors", hold=hold)
        return sum(u.chunk.nbytes * len(live.get(u.digest, ())) for u in units)

    def serve_copy(self, g: str, full: dict[str, torch.Tensor], hold: list) -> int:
        """With the ring released: serve group ``g``, which cannot be read where its tensors lie this sync (the trainer
        re-allocated one, say), from a copy of them. The copy holds a free slot's turn (schedule rule 4 still bounds
        what is resident) until every member released it. A member that does not map this rank's memory cannot be
        served: the version fails (the next one starts with a ring)."""
        ctx, names = self.ctx, self.layout.unit_sources[g]
        if not self.all_map(g):
            raise SyncError(f"producer {self.cfg.rank}: version {self.version} began without a ring (every member "
                            f"mapped this rank's memory) and a member of group {g!r} no longer does: the version "
                            "fails, the next one is served with a ring")
        with ctx.lane:  # after the stream that wrote the weights
            copies = {n: full[n].clone() for n in names}
        blob = ctx.shares.encode(names, copies)
        self.slot_of[g] = self.free.pop(0)
        self.copied.add(g)
        self.max_resident = max(self.max_resident, len(self.slot_of))
        return self.serve_sources(g, copies, blob, hold)

    def pack(self, g: str, slot: int, full: dict[str, torch.Tensor], hold: list) -> int:
        """Pack every unit of group ``g`` into ring slot ``slot`` (on the lane) and have it announced once the pack
        has run; returns the bytes it will send. The slot counts as held from now on."""
        ctx, table, st, lay = self.ctx, self.table, self.st, self.layout
        ring, delta = lay.ring, lay.delta
        base, sent = slot * lay.slot_bytes, 0
        with table.cv:
            live = {d: cs - st.dropped.keys() for d, cs in self.users.items()}
        units = lay.units[g]
        gen = ctx.same_batches.generation  # unchanged since the packers' views were checked: no check per tensor
        with ctx.lane:  # on a GPU: a side stream that first waits for the one that wrote the weights
            for u in units:
                c = u.chunk
                if delta is not None:  # alignment gaps hold a previous group's bytes: they would read as changes
                    ring[base + u.slot_offset: base + u.slot_offset + c.nbytes].zero_()
                u.packer.pack(full, ring[base + u.slot_offset: base + u.slot_offset + c.nbytes], c, base=c.start,
                              gen=gen)
        for u in units:
            sent += u.chunk.nbytes * len(live.get(u.digest, ()))
        with table.cv:
            st.pending[g] = set().union(*(self.users[u.digest] for u in units)) - st.dropped.keys()

        def announce() -> None:  # each plan digest's Ready: chunks, with their checksums or keyed tags
            ready: dict[str, m.Ready] = {}
            regions = [ring[base + u.slot_offset: base + u.slot_offset + u.chunk.nbytes] for u in units]
            sums = [chunk_checksum(r) if ctx.checksums else -1 for r in regions]
            entries: list = [None] * len(units)
            if delta is not None:  # the chunks some member may read as deltas, encoded together
                wanted = []
                for i, u in enumerate(units):
                    if table.any_takes_deltas(live.get(u.digest, set())):
                        wanted.append(i)
                    else:
                        delta.skip(u, g)  # every member reads it dense: no encode, and its base is gone
                area = base + lay.dense_slot  # the slot's delta area
                got = delta.offer(g, [(units[i], regions[i], sums[i] if sums[i] >= 0 else None) for i in wanted],
                                  ring[area: base + lay.slot_bytes], area) if wanted else []
                for i, e in zip(wanted, got):
                    entries[i] = e
            for u, region, csum, entry in zip(units, regions, sums, entries):
                c = u.chunk
                if u.digest not in ready:
                    ready[u.digest] = m.Ready(version=self.version, group=g, chunks=[])
                r = ready[u.digest]
                r.chunks.append([c.index, base + u.slot_offset, c.nbytes, csum])
                if entry is not None:
                    r.deltas.append(entry)
                if ctx.chunk_key is not None:
                    r.tags.append(chunk_tag(ctx.chunk_key, producer=self.cfg.rank, version=self.version, group=g,
                                            chunk=c.index, data=region))
            table.announce(st, g, ready)

        self.pub.submit(announce, what=f"packing group {g!r}", hold=hold)
        return sent

    def outcome(self) -> m.Outcome:
        """A sync returns the VERSION's outcome, not only this rank's part: every member completed (all groups, from
        every producer) or was dropped — or the version failed, which is raised here too (``producer.py`` rule 4)."""
        st, version, cfg = self.st, self.version, self.cfg
        deadline = time.monotonic() + cfg.timeout_s
        while True:
            o = self.ctx.poll_outcome(version)
            if o.failed or st.failed:
                raise ProducerLost(f"producer {cfg.rank}: version {version} failed: {o.failed or st.failed}")
            if o.done:
                return o
            if time.monotonic() > deadline:
                missing = sorted(set(st.members) - set(o.completed) - set(o.dropped))
                raise TransportError(f"producer {cfg.rank}: timed out after {cfg.timeout_s} s waiting for "
                                     f"consumers {missing} to complete version {version} (this rank's part is done)")
            with self.table.cv:
                self.table.prune(version, st)
