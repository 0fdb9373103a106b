"""The consumer's pullers: producer by producer, each group's chunks into its receive slot, then ``Released``.

They follow ``engine/schedule.py``'s rules 8-9. One sync's pullers and its applier (``applier.py``) share a
:class:`PullRound`: the receive slots, what has not landed yet, the groups ready to apply, the first failure
and the counters. Every wait is bounded (``timeout_s``, the lease) and a failure anywhere stops them all::

    rnd = PullRound(consumer, version, session)
    pullers = [Puller(consumer, rnd, p) for p in rnd.serving]     # or [SerialPuller(consumer, rnd)]
    for t in pullers: t.start()
    for t in pullers: t.join()
    rnd.raise_first()
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, Iterator

from ..protocol import messages as m
from .recvslots import RecvSlots
from ...security.chunkmac import check_chunk
from ...delta.receiver import read_held
from ..source_reads.source_open import read_sources
from ..protocol.wire import chunk_checksum
from ...errors import ChecksumError, ChunkMacError, ProducerLost, SyncError, TransportError
from ...plan.pack import ChunkParts

if TYPE_CHECKING:
    from .consumer import Consumer

__all__ = ["PullRound", "Puller", "SerialPuller", "producer_lost"]


def producer_lost(consumer_id: str, p: int, version: int, group: str, e: Exception) -> ProducerLost:
    """The typed error for producer ``p`` lost (during ``version``, or when connecting); names it in ``.producer``."""
    where = f"during version {version} (group {group!r})" if group else "when connecting"
    err = ProducerLost(f"consumer {consumer_id}: producer {p} lost {where}: {e}")
    err.producer = p  # type: ignore[attr-defined]
    return err


class PullRound:
    """One sync of one consumer: what its pullers and its applier share."""

    def __init__(self, consumer: Consumer, version: int, session: str,
                 direct: dict[int, Any] | None = None):
        self.c, self.version, self.session = consumer, version, session
        self.order = [g.name for g in consumer.plan.groups]
        """Every group of the plan, in transfer order."""
        self.direct: dict[int, Any] = dict(direct or {})
        """Producer -> its buffer mapped into this process, for the producers read directly (no receive slot: the
        apply copies straight from their rings; they are released once the group is applied)."""
        self.slots = RecvSlots(len(consumer.slots), self.order) if consumer.slots else None
        self.parts: dict[str, list] = {}
        """Group -> [(chunk, bytes in a producer's mapped buffer)] of its directly read chunks."""
        self._releases: list[Future] = []
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix=f"shardsync-release-{consumer.id}") \
            if self.direct else None
        self.serving = {p: [g for g in self.order if p in consumer.routes[g]]
                        for p in sorted({p for per in consumer.routes.values() for p in per})}
        """Producer -> the groups it serves this consumer, in transfer order."""
        self.missing = {g: set(consumer.routes[g]) for g in self.order}
        """Group -> producers whose part has not landed."""
        self.complete: queue.Queue[str | None] = queue.Queue()
        """Groups whose every part has landed, for the applier (None: no more)."""
        self.errors: list[BaseException] = []
        self.failing = threading.Event()
        self.sourced = 0
        """Groups (per producer) served from a producer's tensors where they lie (source reads)."""
        self.received = 0
        """Bytes landed, summed over the pullers."""
        self.ready_wait_s = 0.0
        """Summed over the pullers: time spent waiting for ``Ready``."""
        self.read_s = 0.0
        """Summed over the pullers: time spent reading (a receive slot, then the bytes)."""
        self._lock = threading.Lock()

    def fail(self, e: BaseException) -> None:
        """Record a failure (surfaced in the calling thread); every puller and the applier stop."""
        self.errors.append(e)
        self.failing.set()
        if self.slots is not None:
            self.slots.wake()

    def read_directly(self, p: int, group: str, parts: list) -> None:
        with self._lock:
            self.parts.setdefault(group, []).extend(parts)

    def take(self, group: str) -> Any:
        """What ``apply`` gets for a landed group: its receive slot, or :class:`ChunkParts` when some of its
        chunks were read directly (the others are in the slot, at their layout offsets)."""
        c = self.c
        if c.held is not None:  # delta sync: every chunk is in the held copy
            return c.held.parts(group)
        with self._lock:
            direct = self.parts.pop(group, None)
        slot = c.slots[self.slots.slot[group]] if self.slots is not None and group in self.slots.slot else None
        if not direct:
            return slot
        have = {ch.index for ch, _ in direct}
        rest = [(ch, slot[ch.start: ch.start + ch.nbytes]) for ch in c.layouts[group].chunks if ch.index not in have] \
            if slot is not None else []
        return ChunkParts(direct + rest)

    def applied(self, group: str) -> None:
        """``group`` is applied (its fence passed): release it to the producers read directly, in the background."""
        assert self._releaser is not None or not self.direct
        for p in sorted(set(self.c.routes[group]) & self.direct.keys()):
            self._releases.append(self._releaser.submit(release, self.c, self, p, group))  # type: ignore[union-attr]

    def free(self, group: str) -> None:
        if self.slots is not None and group in self.slots.slot:
            self.slots.release(group)

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
                    raise SyncError(f"consumer {self.c.id}: a producer did not acknowledge a release of version "
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
    bounded by ``timeout_s`` / the lease, so ``join()`` returns."""

    def __init__(self, consumer: Consumer, rnd: PullRound, p: int):
        super().__init__(name=f"shardsync-pull-{consumer.id}-p{p}", daemon=True)
        self.c, self.rnd, self.p = consumer, rnd, p
        self.todo = rnd.serving[p]
        self.sources = p in rnd.direct and consumer.sources is not None
        """Tell the producer this consumer reads its tensors where they lie (``WaitReady.sources``)."""

    def run(self) -> None:
        c, rnd, p, todo = self.c, self.rnd, self.p, self.todo
        ask = ThreadPoolExecutor(1, thread_name_prefix=f"shardsync-ask-{c.id}-p{p}")
        rel = ThreadPoolExecutor(1, thread_name_prefix=f"shardsync-release-{c.id}-p{p}")
        bound = c.timeout_s + c.lease_s + 5
        try:
            fut = ask.submit(self.wait_ready)
            releases: list[Future] = []
            for k in range(len(todo)):
                t0 = time.perf_counter()
                ready = fut.result(timeout=bound)
                t1 = time.perf_counter()
                if rnd.failing.is_set():
                    return
                if k + 1 < len(todo):  # ask for the next group while this one is read
                    fut = ask.submit(self.wait_ready, after=ready.group)
                got = self.read(ready)
                rnd.timed(t1 - t0, time.perf_counter() - t1)
                if p not in rnd.direct:  # read into a slot: the producer may reuse its ring slot now
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
        if self.p not in self.rnd.direct:
            self.release(ready.group)
        self.rnd.landed(self.p, ready.group, got)

    def wait_ready(self, *, group: str = "", after: str = "") -> m.Ready:
        """The ``Ready`` of ``group``, or of the next group producer ``p`` has packed for us (after ``after``),
        checked against the routes."""
        c, rnd, p, version, expect = self.c, self.rnd, self.p, self.rnd.version, self.todo
        deadline = time.monotonic() + c.timeout_s
        while True:  # short polls: a stopped producer is noticed within the lease, a slow one waited for
            self.check_peers()
            if rnd.failing.is_set():
                raise SyncError(f"consumer {c.id}: version {version} is failing (another puller or the apply)")
            try:
                ready = c.clients[p].call(m.WaitReady(consumer=c.id, session=rnd.session, version=version,
                                                      group=group, after=after, sources=self.sources),
                                          timeout_s=c.lease_s + 1)
            except TransportError as e:
                raise producer_lost(c.id, p, version, "", e) from None
            if not isinstance(ready, m.Pending):
                break
            if time.monotonic() > deadline:
                raise TransportError(f"consumer {c.id}: producer {p} packed nothing more for version {version} "
                                     f"within {c.timeout_s} s (still expected from it: {expect[:3]}...)")
        ready = m.expect(ready, m.Ready, f"producer {p}")
        if group and ready.group != group:
            raise SyncError(f"consumer {c.id}: producer {p} answered for group {ready.group!r}, asked for {group!r}")
        if ready.version != version or ready.group not in expect:
            raise SyncError(f"consumer {c.id}: producer {p} offered group {ready.group!r} of version "
                            f"{ready.version}; routes say it serves {expect[:3]}... of version {version}")
        mine = {i for i, q in enumerate(c.routes[ready.group]) if q == p}
        if {x[0] for x in ready.chunks} != mine:
            raise SyncError(f"consumer {c.id}: producer {p} offers chunks {sorted(x[0] for x in ready.chunks)} "
                            f"of group {ready.group!r}, routes say {sorted(mine)}")
        if ready.tags and len(ready.tags) != len(ready.chunks):  # each tag's 16 bytes are checked at decode
            raise ChunkMacError(f"consumer {c.id}: producer {p} announced {len(ready.chunks)} chunks of group "
                                f"{ready.group!r} (version {version}) with {len(ready.tags)} tags")
        return ready

    def check_peers(self) -> None:
        """Producer ``p`` reported dead by the coordinator (not a stale entry for a restarted rank), or the version
        failed elsewhere: stop now."""
        c, p, version = self.c, self.p, self.rnd.version
        assert c.heartbeat is not None
        view = c.heartbeat.view()
        dead = view["dead_producers"].get(p)
        if dead is not None and dead[0] >= c.peers.get(p, (-1,))[0]:
            raise producer_lost(c.id, p, version, "", TransportError(dead[1]))
        if version in view["failed"]:
            raise SyncError(f"consumer {c.id}: version {version} failed: {view['failed'][version]}")

    def announced(self, ready: m.Ready) -> Iterator[tuple[int, Any, int, int, int, bytes | None]]:
        """Each announced chunk of ``ready.group``: (index, its layout entry, offset, bytes, checksum, tag), once the
        version still stands, this producer is alive and the size is the layout's (else the read stops here)."""
        c, version, group = self.c, self.rnd.version, ready.group
        lay = c.layouts[group]
        tags = ready.tags or [None] * len(ready.chunks)
        for (ci, off, n, checksum), tag in zip(ready.chunks, tags):
            if self.rnd.failing.is_set():  # another puller or the apply failed: stop reading now
                raise SyncError(f"consumer {c.id}: version {version} is failing (another puller or the apply)")
            self.check_peers()  # the version failed at the coordinator, or this producer's lease lapsed
            chunk = lay.chunks[ci]
            if n != chunk.nbytes:
                raise SyncError(f"consumer {c.id}: chunk {ci} of {group!r} is {n} bytes, expected {chunk.nbytes}")
            yield ci, chunk, off, n, checksum, tag

    def read(self, ready: m.Ready) -> int:
        """Read producer ``p``'s chunks of ``ready.group`` into the group's receive slot (or, read directly, note
        where they lie in its mapped buffer); returns the bytes."""
        c, rnd, p, version = self.c, self.rnd, self.p, self.rnd.version
        group = ready.group
        if ready.sources:  # where the producer's tensors lie (``source_open.py``)
            return read_sources(self, ready)
        if c.held is not None:  # delta sync: into the held copy, a delta where one applies (``receiver.py``)
            return read_held(self, ready)
        if p in rnd.direct:
            return self.read_directly(ready)
        assert rnd.slots is not None
        buf = c.slots[rnd.slots.acquire(group, timeout_s=c.timeout_s, abort=rnd.failing,
                                        what=f"group {group!r} of version {version}")]
        got = 0
        for ci, chunk, off, n, checksum, tag in self.announced(ready):
            dst = buf[chunk.start: chunk.start + n]
            try:
                c.transport.read(p, off, n, dst, timeout_s=max(c.lease_s, n / 50e6))
            except TransportError as e:
                raise producer_lost(c.id, p, version, group, e) from None
            self.verify(dst, checksum, tag, group, ci)
            got += n
        return got

    def read_directly(self, ready: m.Ready) -> int:
        """Direct read: check each chunk's range in producer ``p``'s mapped buffer (and its checksum); the apply
        copies from there."""
        c, rnd, p = self.c, self.rnd, self.p
        group, remote = ready.group, rnd.direct[self.p]
        parts, got = [], 0
        for ci, chunk, off, n, checksum, tag in self.announced(ready):
            if off < 0 or off + n > remote.numel():
                raise SyncError(f"consumer {c.id}: producer {p} announced chunk {ci} of {group!r} at [{off}, "
                                f"{off + n}) of its {remote.numel()}-byte buffer; expected {chunk.nbytes} bytes inside")
            data = remote[off: off + n]
            self.verify(data, checksum, tag, group, ci)
            parts.append((chunk, data))
            got += n
        rnd.read_directly(p, group, parts)
        return got

    def release(self, group: str) -> None:
        release(self.c, self.rnd, self.p, group)

    def verify(self, data: Any, checksum: int, tag: bytes | None, group: str, chunk: int,
               hashed: int | None = None) -> None:
        """A keyed tag, where one came (``chunkmac.py``; it supersedes the checksum), else the xxh3 checksum.
        ``hashed``: the xxh3-64 these bytes were just found to have (a delta's own check): not hashed again."""
        c, p, version = self.c, self.p, self.rnd.version
        if tag is not None:
            check_chunk(c.chunk_key, tag, consumer=c.id, producer=p, version=version, group=group, chunk=chunk,
                        data=data)
            return
        if c.require_mac or c.coord.macs:
            raise ChunkMacError(f"consumer {c.id}: producer {p} sent chunk {chunk} of group {group!r} (version "
                                f"{version}) without a keyed tag, and this consumer requires them: run the producers "
                                "with mac=True (ProducerConfig, ShardsyncTrainerInitInfo)")
        if checksum < 0:
            if c.verify_checksums:
                raise ChecksumError(f"consumer {c.id}: producer {p} sent chunk {chunk} of group {group!r} without "
                                    "a checksum, and this consumer requires them (ProducerConfig.verify_checksums)")
            return
        found = hashed if hashed is not None else chunk_checksum(data)
        if found != checksum:
            raise ChecksumError(f"consumer {c.id}: chunk {chunk} of group {group!r} from producer {p} (version "
                                f"{self.rnd.version}) has checksum {found:#x}, the producer computed {checksum:#x}")


def release(c: Consumer, rnd: PullRound, p: int, group: str) -> None:
    """``Released``: producer ``p`` may reuse the ring slot that held ``group``."""
    try:  # its own connection: a release never queues behind a WaitReady the producer is holding
        c.rclients[p].call(m.Released(consumer=c.id, session=rnd.session, version=rnd.version, group=group),
                           timeout_s=c.lease_s + 1)
    except TransportError as e:
        raise producer_lost(c.id, p, rnd.version, group, e) from None


class SerialPuller(threading.Thread):
    """``parallel_producers=False``: one thread, group by group in transfer order, each group's producers one after
    the other (PP stages served serially; the reference the benchmark compares against)."""

    def __init__(self, consumer: Consumer, rnd: PullRound):
        super().__init__(name=f"shardsync-pull-{consumer.id}", daemon=True)
        self.c, self.rnd = consumer, rnd
        self.pullers = {p: Puller(consumer, rnd, p) for p in rnd.serving}
        """Producer -> its pull protocol (never started as threads here)."""

    def run(self) -> None:
        try:
            for g in self.rnd.order:
                for p in sorted(set(self.c.routes[g])):
                    if self.rnd.failing.is_set():
                        return
                    self.pullers[p].pull(g)
        except BaseException as e:
            self.rnd.fail(e)
