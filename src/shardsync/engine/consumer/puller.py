"""The consumer's pullers: producer by producer, each group's chunks into its chunk sink, then ``Released``.

They follow ``engine/schedule.py``'s rules 8-9. One sync's pullers and its applier (``applier.py``) share a
:class:`PullRound`: the producers' chunk sinks (``chunksinks.py``, chosen once per producer when the round starts),
the receive slots, what has not landed yet, the groups ready to apply, the first failure and the counters. Every
wait is bounded (``timeout_s``, the lease) and a failure anywhere stops them all. A puller sees its consumer only
through the :class:`~.pullcontext.PullContext` it is given::

    rnd = PullRound(ctx, version, session, routes, sinks, slots)
    pullers = [Puller(ctx, rnd, p) for p in rnd.serving]     # or [SerialPuller(ctx, rnd)]
    for t in pullers: t.start()
    for t in pullers: t.join()
    rnd.raise_first()
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Iterator

from ..protocol import messages as m
from .chunksinks import ChunkSink
from .pullcontext import PullContext
from .recvslots import SlotPool
from ...security.chunkmac import check_chunk
from ..protocol.wire import chunk_checksum
from ...errors import ChecksumError, ChunkMacError, ConsumerDropped, ProducerLost, SyncError, TransportError
from ...plan.pack import ChunkParts

__all__ = ["PullRound", "Puller", "SerialPuller"]


class PullRound:
    """One sync of one consumer: what its pullers and its applier share."""

    def __init__(self, ctx: PullContext, version: int, session: str, routes: dict[str, list[int]],
                 sinks: dict[int, ChunkSink], slots: SlotPool | None):
        self.ctx, self.version, self.session, self.routes = ctx, version, session, routes
        self.order = [g.name for g in ctx.plan.groups]
        """Every group of the plan, in transfer order."""
        self.sinks = sinks
        """Producer -> where its chunks land this sync (``chunksinks.choose_sink``)."""
        self.slots = slots
        """The receive slots, where some producer is read through them."""
        self._releases: list[Future] = []
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix=f"shardsync-release-{ctx.id}") \
            if any(s.holds_ring for s in sinks.values()) else None
        self.serving = {p: [g for g in self.order if p in routes[g]]
                        for p in sorted({p for per in routes.values() for p in per})}
        """Producer -> the groups it serves this consumer, in transfer order."""
        self.missing = {g: set(routes[g]) for g in self.order}
        """Group -> producers whose part has not landed."""
        self.complete: queue.Queue[str | None] = queue.Queue()
        """Groups whose every part has landed, for the applier (None: no more)."""
        self.errors: list[BaseException] = []
        self.failing = threading.Event()
        self.received = 0
        """Bytes landed, summed over the pullers."""
        self.ready_wait_s = 0.0
        """Summed over the pullers: time spent waiting for ``Ready``."""
        self.read_s = 0.0
        """Summed over the pullers: time spent reading (a receive slot, then the bytes)."""
        self._lock = threading.Lock()

    @property
    def sourced(self) -> int:
        """Groups (per producer) served from a producer's tensors where they lie (source reads)."""
        return sum(s.sourced for s in self.sinks.values())

    def fail(self, e: BaseException) -> None:
        """Record a failure (surfaced in the calling thread); every puller and the applier stop."""
        self.errors.append(e)
        self.failing.set()
        if self.slots is not None:
            self.slots.stop()

    def take(self, group: str) -> Any:
        """What ``apply`` gets for a landed group: its receive slot, or :class:`ChunkParts` when some of its
        chunks landed elsewhere (a mapped ring, the producer's tensors, the held copy; the others are in the slot, at
        their layout offsets)."""
        placed = [x for p in sorted(set(self.routes[group])) for x in self.sinks[p].landed(group)]
        slot = self.slots.view(group) if self.slots is not None else None
        if not placed:
            return slot
        have = {ch.index for ch, _ in placed}
        rest = [(ch, slot[ch.start: ch.start + ch.nbytes]) for ch in self.ctx.layouts[group].chunks
                if ch.index not in have] if slot is not None else []
        return ChunkParts(placed + rest)

    def applied(self, group: str) -> None:
        """``group`` is applied (its fence passed): release it to the producers whose memory it was read from, in
        the background."""
        for p in sorted(p for p in set(self.routes[group]) if self.sinks[p].holds_ring):
            assert self._releaser is not None
            self._releases.append(self._releaser.submit(release, self.ctx, self, p, group))

    def free(self, group: str) -> None:
        if self.slots is not None:
            self.slots.free(group)

    def finish_releases(self, timeout_s: float) -> None:
        """Wait (bounded) for the releases sent after applies; a failed or late one fails the round. After a
        failure none is waited for (the producers learn of the failed version from the coordinator and the
        ``Abandon``)."""
        if self._releaser is None:
            return
        try:
            deadline = time.monotonic() + timeout_s
            for f in self._releases:
                if self.failing.is_set():
                    break
                try:
                    f.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    raise SyncError(f"consumer {self.ctx.id}: a producer did not acknowledge a release of version "
                                    f"{self.version} within {timeout_s} s") from None
        except BaseException as e:
            self.fail(e)
        finally:
            self._releaser.shutdown(wait=False, cancel_futures=True)

    def landed(self, p: int, group: str, nbytes: int) -> None:
        """Producer ``p``'s part of ``group`` is in its slot; the last part hands the group to the applier."""
        with self._lock:
            self.received += nbytes
            self.missing[group].discard(p)
            done = not self.missing[group]
        if done:
            self.complete.put(group)

    def timed(self, ready_wait_s: float, read_s: float) -> None:
        with self._lock:
            self.ready_wait_s += ready_wait_s
            self.read_s += read_s

    def raise_first(self) -> None:
        """Raise the failure that explains the others (a lost producer, a checksum), else the first one."""
        if self.errors:
            raise next((e for e in self.errors if isinstance(e, (ProducerLost, ChecksumError))), self.errors[0])


class Puller(threading.Thread):
    """Producer ``p``'s groups for one sync, in its packing order, pipelined (schedule rule 8): ``Ready`` of the
    next group is asked for while this one is read, and releases go out in the background. Every wait inside is
    bounded by ``timeout_s`` / the lease, so ``join()`` returns. The chunks go to the round's sink for ``p``."""

    def __init__(self, ctx: PullContext, rnd: PullRound, p: int):
        super().__init__(name=f"shardsync-pull-{ctx.id}-p{p}", daemon=True)
        self.ctx, self.rnd, self.p = ctx, rnd, p
        self.todo = rnd.serving[p]
        self.sink = rnd.sinks[p]
        self.sources = self.sink.wants_sources
        """Tell the producer this consumer reads its tensors where they lie (``WaitReady.sources``)."""

    def run(self) -> None:
        ctx, rnd, p, todo = self.ctx, self.rnd, self.p, self.todo
        ask = ThreadPoolExecutor(1, thread_name_prefix=f"shardsync-ask-{ctx.id}-p{p}")
        rel = ThreadPoolExecutor(1, thread_name_prefix=f"shardsync-release-{ctx.id}-p{p}")
        bound = ctx.timeout_s + ctx.lease_s + 5
        try:
            seen: set[str] = set()
            fut: Future | None = ask.submit(self.wait_readies, left=len(todo), seen=seen)
            queued: collections.deque[m.Ready] = collections.deque()
            releases: list[Future] = []
            for k in range(len(todo)):
                t0 = time.perf_counter()
                if not queued:  # every group announced so far comes in one answer
                    assert fut is not None
                    batch = fut.result(timeout=bound)
                    fut = None
                    queued.extend(batch)
                    if k + len(batch) < len(todo):  # ask for the next groups while these are read
                        fut = ask.submit(self.wait_readies, after=batch[-1].group, left=len(todo) - k - len(batch),
                                         seen=seen)
                ready = queued.popleft()
                t1 = time.perf_counter()
                if rnd.failing.is_set():
                    return
                got = self.read(ready)
                rnd.timed(t1 - t0, time.perf_counter() - t1)
                if not self.sink.holds_ring:  # read out of its ring: the producer may reuse the ring slot now
                    releases.append(rel.submit(self.release, ready.group))
                rnd.landed(p, ready.group, got)
                for r in [r for r in releases if r.done()]:
                    r.result()  # a failed release surfaces now
                    releases.remove(r)
            for r in releases:
                r.result(timeout=bound)
        except BaseException as e:
            rnd.fail(e)
        finally:
            ask.shutdown(wait=False, cancel_futures=True)
            rel.shutdown(wait=False, cancel_futures=True)

    def pull(self, group: str) -> None:
        """Ask producer ``p`` for ``group``, read it, release it (the serial reference, one step at a time)."""
        ready = self.wait_ready(group=group)
        got = self.read(ready)
        if not self.sink.holds_ring:
            self.release(ready.group)
        self.rnd.landed(self.p, ready.group, got)

    def wait_ready(self, *, group: str = "", after: str = "") -> m.Ready:
        """The ``Ready`` of ``group``, or of the next group producer ``p`` has packed for us (after ``after``),
        checked against the routes."""
        return self.wait_readies(group=group, after=after)[0]

    def wait_readies(self, *, group: str = "", after: str = "", left: int = 1,
                     seen: set[str] | None = None) -> list[m.Ready]:
        """As :meth:`wait_ready`, with up to ``left - 1`` further groups already announced after it in the same
        answer (``WaitReady.more``), each checked against the routes; at least one. ``seen``: the groups this round
        was offered already (none may come twice), updated."""
        ctx, rnd, p, version = self.ctx, self.rnd, self.p, self.rnd.version
        more = 0 if group else max(0, min(left - 1, m.MAX_MORE))
        deadline = time.monotonic() + ctx.timeout_s
        while True:  # short polls: a stopped producer is noticed within the lease, a slow one waited for
            self.check_peers()
            if rnd.failing.is_set():
                raise SyncError(f"consumer {ctx.id}: version {version} is failing (another puller or the apply)")
            try:
                ready = ctx.clients[p].call(m.WaitReady(consumer=ctx.id, session=rnd.session, version=version,
                                                        group=group, after=after, sources=self.sources,
                                                        deltas=self.sink.takes_deltas, more=more),
                                            timeout_s=ctx.lease_s + 1)
            except TransportError as e:
                raise ctx.lost(p, version, "", e) from None
            if not isinstance(ready, m.Pending):
                break
            if time.monotonic() > deadline:
                raise TransportError(f"consumer {ctx.id}: producer {p} packed nothing more for version {version} "
                                     f"within {ctx.timeout_s} s (still expected from it: {self.todo[:3]}...)")
        if isinstance(ready, m.Readies):
            if len(ready.readies) > more + 1:
                raise SyncError(f"consumer {ctx.id}: producer {p} answered {len(ready.readies)} groups, asked for "
                                f"at most {more + 1}")
            out = [self.checked(r, group) for r in ready.readies]
        else:
            out = [self.checked(m.expect(ready, m.Ready, f"producer {p}"), group)]
        if seen is not None:
            for r in out:
                if r.group in seen:
                    raise SyncError(f"consumer {ctx.id}: producer {p} offered group {r.group!r} of version {version} "
                                    "twice")
                seen.add(r.group)
        return out

    def checked(self, ready: m.Ready, group: str = "") -> m.Ready:
        """``ready`` (of ``group`` where one was asked for) against this round's version and routes."""
        ctx, rnd, p, version, expect = self.ctx, self.rnd, self.p, self.rnd.version, self.todo
        if group and ready.group != group:
            raise SyncError(f"consumer {ctx.id}: producer {p} answered for group {ready.group!r}, asked for {group!r}")
        if ready.version != version or ready.group not in expect:
            raise SyncError(f"consumer {ctx.id}: producer {p} offered group {ready.group!r} of version "
                            f"{ready.version}; routes say it serves {expect[:3]}... of version {version}")
        mine = {i for i, q in enumerate(rnd.routes[ready.group]) if q == p}
        if {x[0] for x in ready.chunks} != mine:
            raise SyncError(f"consumer {ctx.id}: producer {p} offers chunks {sorted(x[0] for x in ready.chunks)} "
                            f"of group {ready.group!r}, routes say {sorted(mine)}")
        if ready.tags and len(ready.tags) != len(ready.chunks):  # each tag's 16 bytes are checked at decode
            raise ChunkMacError(f"consumer {ctx.id}: producer {p} announced {len(ready.chunks)} chunks of group "
                                f"{ready.group!r} (version {version}) with {len(ready.tags)} tags")
        return ready

    def check_peers(self) -> None:
        """Producer ``p`` reported dead by the coordinator (not a stale entry for a restarted rank), or the version
        failed elsewhere: stop now."""
        ctx, p, version = self.ctx, self.p, self.rnd.version
        view = ctx.peer_view()
        dead = view["dead_producers"].get(p)
        if dead is not None and dead[0] >= ctx.peers.get(p, (-1,))[0]:
            raise ctx.lost(p, version, "", TransportError(dead[1]))
        if version in view["failed"]:
            raise SyncError(f"consumer {ctx.id}: version {version} failed: {view['failed'][version]}")

    def announced(self, ready: m.Ready) -> Iterator[tuple[int, Any, int, int, int, bytes | None]]:
        """Each announced chunk of ``ready.group``: (index, its layout entry, offset, bytes, checksum, tag), once the
        version still stands, this producer is alive and the size is the layout's (else the read stops here)."""
        ctx, version, group = self.ctx, self.rnd.version, ready.group
        lay = ctx.layouts[group]
        tags = ready.tags or [None] * len(ready.chunks)
        for (ci, off, n, checksum), tag in zip(ready.chunks, tags):
            if self.rnd.failing.is_set():  # another puller or the apply failed: stop reading now
                raise SyncError(f"consumer {ctx.id}: version {version} is failing (another puller or the apply)")
            self.check_peers()  # the version failed at the coordinator, or this producer's lease lapsed
            chunk = lay.chunks[ci]
            if n != chunk.nbytes:
                raise SyncError(f"consumer {ctx.id}: chunk {ci} of {group!r} is {n} bytes, expected {chunk.nbytes}")
            yield ci, chunk, off, n, checksum, tag

    def read(self, ready: m.Ready) -> int:
        """Producer ``p``'s chunks of ``ready.group`` into its sink (a receive slot, its mapped ring, the held copy;
        its tensors where the ``Ready`` names them); returns the bytes."""
        return self.sink.read(ready, self)

    def release(self, group: str) -> None:
        release(self.ctx, self.rnd, self.p, group)

    def verify(self, data: Any, checksum: int, tag: bytes | None, group: str, chunk: int,
               hashed: int | None = None) -> None:
        """A keyed tag, where one came (``chunkmac.py``; it supersedes the checksum), else the xxh3 checksum.
        ``hashed``: the xxh3-64 these bytes were just found to have (a delta's own check): not hashed again."""
        ctx, p, version = self.ctx, self.p, self.rnd.version
        if tag is not None:
            check_chunk(ctx.chunk_key, tag, consumer=ctx.id, producer=p, version=version, group=group, chunk=chunk,
                        data=data)
            return
        if ctx.mac_required():
            raise ChunkMacError(f"consumer {ctx.id}: producer {p} sent chunk {chunk} of group {group!r} (version "
                                f"{version}) without a keyed tag, and this consumer requires them: run the producers "
                                "with mac=True (ProducerConfig, ShardsyncTrainerInitInfo)")
        if checksum < 0:
            if ctx.verify_checksums:
                raise ChecksumError(f"consumer {ctx.id}: producer {p} sent chunk {chunk} of group {group!r} without "
                                    "a checksum, and this consumer requires them (ProducerConfig.verify_checksums)")
            return
        found = hashed if hashed is not None else chunk_checksum(data)
        if found != checksum:
            bad = ChecksumError(f"consumer {ctx.id}: chunk {chunk} of group {group!r} from producer {p} (version "
                                f"{self.rnd.version}) has checksum {found:#x}, the producer computed {checksum:#x}")
            self.dropped_cause(group, bad)
            raise bad

    def dropped_cause(self, group: str, bad: BaseException) -> None:
        """Bytes that do not match their checksum may have been overwritten: this consumer was dropped from the
        version (a straggler) and the producer reused the ring slot. Ask it (a ``Released``, refused for a dropped
        member): ``ConsumerDropped`` is then the cause raised, the mismatch its context."""
        try:
            release(self.ctx, self.rnd, self.p, group)
        except ConsumerDropped as e:
            raise e from bad
        except Exception:
            return


def release(ctx: PullContext, rnd: PullRound, p: int, group: str) -> None:
    """``Released``: producer ``p`` may reuse the ring slot that held ``group``."""
    try:  # its own connection: a release never queues behind a WaitReady the producer is holding
        ctx.rclients[p].call(m.Released(consumer=ctx.id, session=rnd.session, version=rnd.version, group=group),
                             timeout_s=ctx.lease_s + 1)
    except TransportError as e:
        raise ctx.lost(p, rnd.version, group, e) from None


class SerialPuller(threading.Thread):
    """``parallel_producers=False``: one thread, group by group in transfer order, each group's producers one after
    the other (PP stages served serially; the reference the benchmark compares against)."""

    def __init__(self, ctx: PullContext, rnd: PullRound):
        super().__init__(name=f"shardsync-pull-{ctx.id}", daemon=True)
        self.rnd = rnd
        self.pullers = {p: Puller(ctx, rnd, p) for p in rnd.serving}
        """Producer -> its pull protocol (never started as threads here)."""

    def run(self) -> None:
        try:
            for g in self.rnd.order:
                for p in sorted(set(self.rnd.routes[g])):
                    if self.rnd.failing.is_set():
                        return
                    self.pullers[p].pull(g)
        except BaseException as e:
            self.rnd.fail(e)
