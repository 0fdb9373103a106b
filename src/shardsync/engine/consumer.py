"""Inference side: record the plan, learn the routes, pull chunks, apply groups in the background.

The consumer's half of the schedule:

1. ``init``: ``Hello`` (session credential; the lease starts and a heartbeat keeps it), record the
   plan, ``RegisterPlan`` (routes). A failure to start is reported (``InitFailed``) before it is raised.
2. Each sync starts with ``BeginSync``: this consumer must be a member of the version, and learns the
   current address and transport descriptor of the producers it pulls from (a restarted producer is
   reconnected here).
3. One puller thread per producer, all at once (every PP stage, every EP rank concurrently): each asks
   its producer for "the next group you have for me" (producers pack in transfer order) — and, while it
   reads that group, already for the one after it (``WaitReady.after``) — reads the group's chunks into
   the group's receive slot (``engine/recvslots.py``: ``recv_slots`` buffers of the largest group's size,
   allocated once — the receive-memory budget; its rules say why this cannot deadlock) and sends ``Released`` (on a connection of its own, in the background) right after the bytes
   have landed.
4. A group whose every producer's part has landed goes to the apply thread (unpack → scatter into the
   engine's buffers → the engine's per-layer processing), which overlaps the pulls; its slot is reused
   once it has been applied. Groups may complete out of transfer order (PP stages in parallel).
5. A producer that dies or stops answering is detected within the lease bound (its connection breaks,
   a poll is not answered, or the coordinator reports it dead): :class:`ProducerLost`. Any failure —
   or a version this engine rejects — is sent to the producers (``Abandon``) before it is raised, so
   nobody waits for this consumer. ``torn`` says whether a failed sync had already applied groups (the
   engine then holds a mix and must not serve until a later sync completes); ``version`` is the last
   complete one.
6. If the lease expires (the process was paused), the heartbeat rejoins with the same plan and a new
   session: the next version is received in full.

    consumer = Consumer("r0/tp1", coordinator_address, token="t", record=record_fn, apply=apply_fn)
    consumer.init()          # Hello -> record plan -> RegisterPlan -> Routes
    consumer.sync(version=1)
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from . import messages as m
from .control import ControlClient
from .heartbeat import Heartbeat
from .lanes import Lane, hot_path
from .recvslots import RecvSlots
from .wire import DEFAULT_MAX_FRAME, chunk_checksum, parse_address
from ..errors import ChecksumError, ProducerLost, SyncError, TransportError
from ..plan.pack import GroupLayout
from ..plan.route import chunk_layouts, holders_from_ownership
from ..transport import Transport, make_transport
from ..types import ParamMeta, Plan

RecordFn = Callable[[Sequence[ParamMeta]], Plan]
ApplyFn = Callable[[str, torch.Tensor], None]


def _expect(reply: Any, cls: type, peer: str) -> Any:
    if not isinstance(reply, cls):
        raise TransportError(f"{peer} answered {type(reply).__name__}, expected {cls.__name__}")
    return reply


class Consumer:
    def __init__(self, consumer_id: str, coordinator: list[Any] | str, *, token: str, record: RecordFn,
                 apply: ApplyFn,
                 transport: str | Transport = "tcp", transport_kwargs: dict[str, Any] | None = None,
                 timeout_s: float = 120.0, recv_slots: int = 4, init_timeout_s: float = 600.0,
                 recv_budget_bytes: int | None = None, parallel_producers: bool = True,
                 verify_checksums: bool = False, max_frame_bytes: int = DEFAULT_MAX_FRAME,
                 device: str | None = None, switch_interval_s: float | None = 0.0002, node: str = ""):
        self.id, self.coordinator, self.token = consumer_id, parse_address(coordinator), token
        self.record, self.apply = record, apply
        kw = dict(transport_kwargs or {})
        if transport in ("tcp", "nccl", "auto"):
            kw.setdefault("token", token)  # the data plane is authenticated with the group's token too
        self.transport = transport if not isinstance(transport, str) else make_transport(transport, **kw)
        self.timeout_s, self.recv_slots, self.init_timeout_s = timeout_s, recv_slots, init_timeout_s
        self.recv_budget_bytes = recv_budget_bytes
        """Receive memory cap: ``recv_slots`` is lowered to fit it (at least 2 slots of the largest group)."""
        self.parallel_producers = parallel_producers
        """False: one puller, group by group in transfer order, each group's producers one after the other (PP
        stages served serially; kept as the reference the benchmark compares against)."""
        self.verify_checksums, self.max_frame_bytes = verify_checksums, max_frame_bytes
        self.node = node
        """Where this consumer runs ("" = unknown): producers on the same node serve it first where they can."""
        self.switch_interval_s = switch_interval_s
        """While a sync runs, the GIL switch interval (and the cyclic GC paused); None: leave them
        (``engine/lanes.hot_path``)."""
        self.lane = Lane(device)
        """Where the receive slots live and ``apply`` runs (``"cuda:1"``; None: CPU). On a GPU the slots are
        allocated there once (``stats["recv_bytes"]``: subtract it from ``gpu_memory_utilization``), transfers land
        on the transport's own streams, and ``apply`` runs on a side stream whose work is waited for (an event, not
        a device synchronize) before its slot is reused."""
        if self.lane.cuda and not self.transport.caps.gpu:
            raise SyncError(f"consumer {consumer_id}: transport {self.transport.name!r} cannot move GPU memory "
                            f"(receive slots on {device}); use cuda_ipc, nccl or nixl")
        self.stats: dict[str, Any] = {}
        self.version = 0
        """The last version this consumer completed."""
        self.torn = False
        """A failed sync applied some groups: the engine holds a mix of versions until a sync completes."""
        self.rejoins = 0
        self.heartbeat: Heartbeat | None = None
        self.clients: dict[int, ControlClient] = {}
        self.rclients: dict[int, ControlClient] = {}  # releases: a second connection per producer
        self.peers: dict[int, tuple[int, Any]] = {}  # producer -> (incarnation, desc) connected
        self._lock = threading.Lock()  # session changes (rejoin) vs. a sync reading it
        self._apply_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ init / rejoin
    def init(self) -> Plan:
        t0 = time.perf_counter()
        peer = "coordinator (producer 0)"
        self.coord = ControlClient(self.coordinator, self.token, peer=peer, max_frame_bytes=self.max_frame_bytes)
        w = _expect(self.coord.call(m.Hello(consumer=self.id), timeout_s=self.init_timeout_s + 5), m.Welcome, peer)
        self.session, self.lease_s = w.session, w.lease_s
        self.heartbeat = Heartbeat(self.coordinator, self.token, m.Renew(consumer=self.id, session=self.session),
                                   lease_s=w.lease_s, who=f"consumer {self.id}", on_dropped=self._rejoin)
        try:
            self.metas = [ParamMeta.from_dict(d) for d in w.metadata]
            self.plan = self.record(self.metas)
            holders = holders_from_ownership(w.held, [x.name for x in self.metas])
            self.layouts: dict[str, GroupLayout] = chunk_layouts(self.plan, holders,
                                                                 max_chunk_bytes=w.max_chunk_bytes)
            slot = max(max((lay.nbytes for lay in self.layouts.values()), default=0), 1)
            n = self.recv_slots
            if self.recv_budget_bytes is not None:
                n = min(n, self.recv_budget_bytes // slot)
                if n < 2:
                    raise SyncError(f"consumer {self.id}: recv_budget_bytes={self.recv_budget_bytes} holds fewer than "
                                    f"two receive slots of its largest group ({slot} bytes); it needs {2 * slot}")
            self.slots = [torch.empty(slot, dtype=torch.uint8, device=self.lane.device) for _ in range(n)]
            routes = _expect(self.coord.call(m.RegisterPlan(consumer=self.id, session=self.session,
                                                            plan=self.plan.to_json(), node=self.node),
                                             timeout_s=self.init_timeout_s + 5), m.Routes, peer)
            self.routes = routes.routes
        except BaseException as e:  # tell the coordinator now: init must not wait for this consumer
            try:
                self.coord.call(m.InitFailed(consumer=self.id, session=self.session, reason=f"{type(e).__name__}: {e}"),
                                timeout_s=5)
            except Exception:
                pass
            self.heartbeat.stop()
            raise
        self.stats = {"consumer": self.id, "init_s": time.perf_counter() - t0, "plan_bytes": self.plan.nbytes,
                      "producers": sorted({p for per in self.routes.values() for p in per})}
        return self.plan

    def _rejoin(self, why: str) -> None:
        """Our lease expired (we were paused or cut off): join again with the plan we have."""
        with self._lock:
            w = _expect(self.coord.call(m.Hello(consumer=self.id), timeout_s=self.timeout_s), m.Welcome, "coordinator")
            r = _expect(self.coord.call(m.RegisterPlan(consumer=self.id, session=w.session, plan=self.plan.to_json(),
                                                       node=self.node),
                                        timeout_s=self.timeout_s), m.Routes, "coordinator")
            self.session, self.routes = w.session, r.routes
            assert self.heartbeat is not None
            self.heartbeat.set_renew(m.Renew(consumer=self.id, session=w.session))
            self.rejoins += 1

    # ------------------------------------------------------------------ sync
    def abandon(self, version: int, reason: str, *, lost_producer: int = -1) -> None:
        """Leave ``version`` (this engine rejected or failed it): no producer waits for us. Best effort."""
        msg = m.Abandon(consumer=self.id, session=self.session, version=version, reason=reason[:2000],
                        lost_producer=lost_producer)
        for c in [self.coord, *self.clients.values()]:
            try:
                c.call(msg, timeout_s=2)
            except Exception:
                pass

    def sync(self, version: int) -> dict[str, Any]:
        if self._apply_thread is not None and self._apply_thread.is_alive():
            raise SyncError(f"consumer {self.id}: the previous sync's apply thread is still running; this consumer "
                            "must be re-initialised before it syncs again")
        if version <= self.version:
            why = f"version {version} is not newer than the version it holds ({self.version})"
            self.abandon(version, why)
            raise SyncError(f"consumer {self.id}: {why}")
        if self.heartbeat is not None and self.heartbeat.dropped:
            self._rejoin(self.heartbeat.dropped)
        applied_any = [False]
        try:
            with hot_path(self.switch_interval_s):
                stats = self._sync(version, applied_any)
        except BaseException as e:
            self.torn = self.torn or applied_any[0]
            self.abandon(version, f"{type(e).__name__}: {e}", lost_producer=getattr(e, "producer", -1))
            raise
        self.version, self.torn = version, False
        return stats

    def _sync(self, version: int, applied_any: list[bool]) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self._lock:
            session = self.session
        view = _expect(self.coord.call(m.BeginSync(version=version, consumer=self.id, session=session),
                                       timeout_s=self.timeout_s + 5), m.SyncView, "coordinator (producer 0)")
        self._connect(view.producers)
        order = [g.name for g in self.plan.groups]
        slots = RecvSlots(len(self.slots), order)
        serving = {p: [g for g in order if p in self.routes[g]] for p in sorted({p for per in self.routes.values()
                                                                                for p in per})}
        missing = {g: set(self.routes[g]) for g in order}  # group -> producers whose part has not landed
        work: queue.Queue[str | None] = queue.Queue()
        errors: list[BaseException] = []
        failing = threading.Event()
        applied = [0.0]
        lock = threading.Lock()
        received = [0]
        clock = {"ready_wait_s": 0.0, "read_s": 0.0}  # summed over pullers: waiting for Ready, reading (slot + bytes)

        def applier() -> None:
            while True:
                g = work.get()
                if g is None:
                    return
                try:
                    if not errors:
                        ta = time.perf_counter()
                        applied_any[0] = True
                        with self.lane:
                            self.apply(g, self.slots[slots.slot[g]])
                        self.lane.fence(timeout_s=self.timeout_s, what=f"consumer {self.id}: applying group {g!r}")
                        applied[0] += time.perf_counter() - ta
                except BaseException as e:  # surfaces in the calling thread
                    errors.append(e)
                    failing.set()
                finally:
                    slots.release(g)

        def landed(p: int, g: str, n: int) -> None:
            with lock:
                received[0] += n
                missing[g].discard(p)
                done = not missing[g]
            if done:
                work.put(g)

        def puller(p: int) -> None:  # rule 3: one per producer, all at once, pipelined
            todo = serving[p]
            ask = ThreadPoolExecutor(1, thread_name_prefix=f"shardsync-ask-{self.id}-p{p}")
            rel = ThreadPoolExecutor(1, thread_name_prefix=f"shardsync-release-{self.id}-p{p}")
            bound = self.timeout_s + self.lease_s + 5
            try:
                fut = ask.submit(self._wait_ready, p, version, session, todo, failing)
                releases: list[Future] = []
                for k in range(len(todo)):
                    t0 = time.perf_counter()
                    ready = fut.result(timeout=bound)
                    t1 = time.perf_counter()
                    if failing.is_set():
                        return
                    if k + 1 < len(todo):  # ask for the next group while this one is read
                        fut = ask.submit(self._wait_ready, p, version, session, todo, failing, after=ready.group)
                    got = self._read(p, version, ready, slots, failing)
                    with lock:
                        clock["ready_wait_s"] += t1 - t0
                        clock["read_s"] += time.perf_counter() - t1
                    releases.append(rel.submit(self._release, p, version, session, ready.group))
                    landed(p, ready.group, got)
                    for r in [r for r in releases if r.done()]:
                        r.result()  # a failed release surfaces now
                        releases.remove(r)
                for r in releases:
                    r.result(timeout=bound)
            except BaseException as e:
                errors.append(e)
                failing.set()
                slots.wake()
            finally:
                ask.shutdown(wait=False, cancel_futures=True)
                rel.shutdown(wait=False, cancel_futures=True)

        def serial() -> None:  # parallel_producers=False: group by group, producer by producer
            try:
                for g in order:
                    for p in sorted(set(self.routes[g])):
                        if failing.is_set():
                            return
                        landed(p, *self._pull_next(p, version, session, serving[p], slots, failing, group=g))
            except BaseException as e:
                errors.append(e)
                failing.set()
                slots.wake()

        th = threading.Thread(target=applier, name=f"shardsync-apply-{self.id}", daemon=True)
        self._apply_thread = th
        th.start()
        pullers = [threading.Thread(target=puller, args=(p,), name=f"shardsync-pull-{self.id}-p{p}", daemon=True)
                   for p in serving] if self.parallel_producers else \
            [threading.Thread(target=serial, name=f"shardsync-pull-{self.id}", daemon=True)]
        try:
            for t in pullers:
                t.start()
            for t in pullers:
                t.join()  # every wait inside a puller is bounded by timeout_s / the lease
        finally:
            work.put(None)
            th.join(timeout=self.timeout_s)
        if errors:
            raise next((e for e in errors if isinstance(e, (ProducerLost, ChecksumError))), errors[0])
        if th.is_alive():
            raise SyncError(f"consumer {self.id}: applying version {version} did not finish within {self.timeout_s} s")
        self.coord.call(m.Completed(consumer=self.id, session=session, version=version), timeout_s=self.lease_s + 1)
        self.stats.update(version=version, seconds=time.perf_counter() - t0, bytes_received=received[0],
                          apply_s=applied[0], rejoins=self.rejoins, recv_slots_used=slots.max_in_use,
                          recv_bytes=len(self.slots) * self.slots[0].numel(), pulled_from=sorted(serving),
                          transports={p: getattr(self.transport, "chosen", {}).get(p, self.transport.name)
                                      for p in serving}, **clock)
        return dict(self.stats)

    def _connect(self, producers: list[dict[str, Any]]) -> None:
        for info in producers:
            p, inc, desc = int(info["rank"]), int(info["incarnation"]), info["desc"]
            if self.peers.get(p) == (inc, desc):
                continue
            for old in (self.clients.pop(p, None), self.rclients.pop(p, None)):
                if old is not None:
                    old.close()
            try:
                self.clients[p] = ControlClient(info["address"], self.token, peer=f"producer {p}",
                                                  connect_timeout_s=self.lease_s)
                self.rclients[p] = ControlClient(info["address"], self.token, peer=f"producer {p}",
                                                   connect_timeout_s=self.lease_s)
                self.transport.connect(p, desc)
            except TransportError as e:
                raise self._lost(p, -1, "", e) from None
            self.peers[p] = (inc, desc)

    def _lost(self, p: int, version: int, group: str, e: Exception) -> ProducerLost:
        where = f"during version {version} (group {group!r})" if group else "when connecting"
        err = ProducerLost(f"consumer {self.id}: producer {p} lost {where}: {e}")
        err.producer = p  # type: ignore[attr-defined]
        return err

    def _check_peers(self, p: int, version: int, group: str) -> None:
        assert self.heartbeat is not None
        view = self.heartbeat.view()
        dead = view["dead_producers"].get(p)
        if dead is not None and dead[0] >= self.peers.get(p, (-1,))[0]:  # not a stale entry for a restarted rank
            raise self._lost(p, version, group, TransportError(dead[1]))
        if version in view["failed"]:
            raise SyncError(f"consumer {self.id}: version {version} failed: {view['failed'][version]}")

    def _pull_next(self, p: int, version: int, session: str, expect: list[str], slots: RecvSlots,
                   failing: threading.Event, group: str = "") -> tuple[str, int]:
        """Ask producer ``p`` for the next group it has for us (or for ``group``), read it, release it."""
        ready = self._wait_ready(p, version, session, expect, failing, group=group)
        got = self._read(p, version, ready, slots, failing)
        self._release(p, version, session, ready.group)
        return ready.group, got

    def _wait_ready(self, p: int, version: int, session: str, expect: list[str], failing: threading.Event, *,
                    group: str = "", after: str = "") -> m.Ready:
        """The ``Ready`` of ``group``, or of the next group producer ``p`` has packed for us (after ``after``),
        checked against the routes."""
        deadline = time.monotonic() + self.timeout_s
        while True:  # short polls: a stopped producer is noticed within the lease, a slow one waited for
            self._check_peers(p, version, "")
            if failing.is_set():
                raise SyncError(f"consumer {self.id}: version {version} is failing (another puller or the apply)")
            try:
                ready = self.clients[p].call(m.WaitReady(consumer=self.id, session=session, version=version,
                                                         group=group, after=after), timeout_s=self.lease_s + 1)
            except TransportError as e:
                raise self._lost(p, version, "", e) from None
            if not isinstance(ready, m.Pending):
                break
            if time.monotonic() > deadline:
                raise TransportError(f"consumer {self.id}: producer {p} packed nothing more for version {version} "
                                     f"within {self.timeout_s} s (still expected from it: {expect[:3]}...)")
        ready = _expect(ready, m.Ready, f"producer {p}")
        if group and ready.group != group:
            raise SyncError(f"consumer {self.id}: producer {p} answered for group {ready.group!r}, asked for {group!r}")
        if ready.version != version or ready.group not in expect:
            raise SyncError(f"consumer {self.id}: producer {p} offered group {ready.group!r} of version "
                            f"{ready.version}; routes say it serves {expect[:3]}... of version {version}")
        mine = {i for i, q in enumerate(self.routes[ready.group]) if q == p}
        if {c[0] for c in ready.chunks} != mine:
            raise SyncError(f"consumer {self.id}: producer {p} offers chunks {sorted(c[0] for c in ready.chunks)} "
                            f"of group {ready.group!r}, routes say {sorted(mine)}")
        return ready

    def _read(self, p: int, version: int, ready: m.Ready, slots: RecvSlots, failing: threading.Event) -> int:
        """Read producer ``p``'s chunks of ``ready.group`` into the group's receive slot; returns the bytes."""
        group, lay = ready.group, self.layouts[ready.group]
        buf = self.slots[slots.acquire(group, timeout_s=self.timeout_s, abort=failing,
                                       what=f"group {group!r} of version {version}")]
        got = 0
        for ci, off, n, checksum in ready.chunks:
            c = lay.chunks[ci]
            if n != c.nbytes:
                raise SyncError(f"consumer {self.id}: chunk {ci} of {group!r} is {n} bytes, expected {c.nbytes}")
            dst = buf[c.start: c.start + n]
            try:
                self.transport.read(p, off, n, dst, timeout_s=max(self.lease_s, n / 50e6))
            except TransportError as e:
                raise self._lost(p, version, group, e) from None
            self._verify(dst, checksum, p, group, ci, version)
            got += n
        return got

    def _release(self, p: int, version: int, session: str, group: str) -> None:
        try:  # its own connection: a release never queues behind a WaitReady the producer is holding
            self.rclients[p].call(m.Released(consumer=self.id, session=session, version=version, group=group),
                                  timeout_s=self.lease_s + 1)
        except TransportError as e:
            raise self._lost(p, version, group, e) from None

    def _verify(self, data: torch.Tensor, checksum: int, p: int, group: str, chunk: int, version: int) -> None:
        if checksum < 0:
            if self.verify_checksums:
                raise ChecksumError(f"consumer {self.id}: producer {p} sent chunk {chunk} of group {group!r} without "
                                    "a checksum, and this consumer requires them (ProducerConfig.verify_checksums)")
            return
        found = chunk_checksum(data)
        if found != checksum:
            raise ChecksumError(f"consumer {self.id}: chunk {chunk} of group {group!r} from producer {p} (version "
                                f"{version}) has checksum {found:#x}, the producer computed {checksum:#x}")

    def close(self, *, goodbye: bool = True) -> None:
        if goodbye and hasattr(self, "coord"):
            try:
                self.coord.call(m.Goodbye(consumer=self.id, session=self.session), timeout_s=5)
            except Exception:
                pass
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for c in [*self.clients.values(), *self.rclients.values()]:
            c.close()
        if hasattr(self, "coord"):
            self.coord.close()
        self.transport.close()
