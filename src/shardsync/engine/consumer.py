"""Inference side: record the plan, learn the routes, pull chunks, apply groups in the background.

The consumer's half of the schedule:

1. ``init``: ``Hello`` (session credential; the lease starts and a heartbeat keeps it), record the
   plan, ``RegisterPlan`` (routes). A failure to start is reported (``InitFailed``) before it is raised.
2. Each sync starts with ``BeginSync``: this consumer must be a member of the version, and learns the
   current address and transport descriptor of the producers it pulls from (a restarted producer is
   reconnected here).
3. Groups are pulled in transfer order into a ring of ``recv_slots`` receive buffers (each the size
   of the largest group). For each group, every chunk is read from the producer routed to it, as soon
   as that producer says ``Ready``; ``Released`` goes back right after the bytes have landed.
4. A full group goes to the apply thread (unpack → scatter into the engine's buffers → the engine's
   per-layer processing), which overlaps the pulls of the next groups; a receive slot is reused once
   its group has been applied.
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
from typing import Any, Callable, Sequence

import torch

from . import control as m
from .heartbeat import Heartbeat
from .wire import DEFAULT_MAX_FRAME, chunk_checksum
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
    def __init__(self, consumer_id: str, coordinator: list[Any], *, token: str, record: RecordFn, apply: ApplyFn,
                 transport: str | Transport = "tcp", transport_kwargs: dict[str, Any] | None = None,
                 timeout_s: float = 120.0, recv_slots: int = 2, init_timeout_s: float = 600.0,
                 verify_checksums: bool = False, max_frame_bytes: int = DEFAULT_MAX_FRAME):
        self.id, self.coordinator, self.token = consumer_id, coordinator, token
        self.record, self.apply = record, apply
        kw = dict(transport_kwargs or {})
        if transport == "tcp":
            kw.setdefault("token", token)  # the data plane is authenticated with the group's token too
        self.transport = transport if not isinstance(transport, str) else make_transport(transport, **kw)
        self.timeout_s, self.recv_slots, self.init_timeout_s = timeout_s, recv_slots, init_timeout_s
        self.verify_checksums, self.max_frame_bytes = verify_checksums, max_frame_bytes
        self.stats: dict[str, Any] = {}
        self.version = 0
        """The last version this consumer completed."""
        self.torn = False
        """A failed sync applied some groups: the engine holds a mix of versions until a sync completes."""
        self.rejoins = 0
        self.heartbeat: Heartbeat | None = None
        self.clients: dict[int, m.ControlClient] = {}
        self.peers: dict[int, tuple[int, Any]] = {}  # producer -> (incarnation, desc) connected
        self._lock = threading.Lock()  # session changes (rejoin) vs. a sync reading it
        self._apply_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ init / rejoin
    def init(self) -> Plan:
        t0 = time.perf_counter()
        peer = "coordinator (producer 0)"
        self.coord = m.ControlClient(self.coordinator, self.token, peer=peer, max_frame_bytes=self.max_frame_bytes)
        w = _expect(self.coord.call(m.Hello(consumer=self.id), timeout_s=self.init_timeout_s + 5), m.Welcome, peer)
        self.session, self.lease_s = w.session, w.lease_s
        self.heartbeat = Heartbeat(self.coordinator, self.token, m.Renew(consumer=self.id, session=self.session),
                                   lease_s=w.lease_s, who=f"consumer {self.id}", on_dropped=self._rejoin)
        try:
            self.metas = [ParamMeta.from_dict(d) for d in w.metadata]
            self.plan = self.record(self.metas)
            routes = _expect(self.coord.call(m.RegisterPlan(consumer=self.id, session=self.session,
                                                            plan=self.plan.to_json()),
                                             timeout_s=self.init_timeout_s + 5), m.Routes, peer)
        except BaseException as e:  # tell the coordinator now: init must not wait for this consumer
            try:
                self.coord.call(m.InitFailed(consumer=self.id, session=self.session, reason=f"{type(e).__name__}: {e}"),
                                timeout_s=5)
            except Exception:
                pass
            self.heartbeat.stop()
            raise
        holders = holders_from_ownership(w.held, [x.name for x in self.metas])
        self.layouts: dict[str, GroupLayout] = chunk_layouts(self.plan, holders, max_chunk_bytes=w.max_chunk_bytes)
        self.routes = routes.routes
        slot = max((lay.nbytes for lay in self.layouts.values()), default=0)
        self.slots = [torch.empty(max(slot, 1), dtype=torch.uint8) for _ in range(self.recv_slots)]
        self.stats = {"consumer": self.id, "init_s": time.perf_counter() - t0, "plan_bytes": self.plan.nbytes,
                      "producers": sorted({p for per in self.routes.values() for p in per})}
        return self.plan

    def _rejoin(self, why: str) -> None:
        """Our lease expired (we were paused or cut off): join again with the plan we have."""
        with self._lock:
            w = _expect(self.coord.call(m.Hello(consumer=self.id), timeout_s=self.timeout_s), m.Welcome, "coordinator")
            r = _expect(self.coord.call(m.RegisterPlan(consumer=self.id, session=w.session, plan=self.plan.to_json()),
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
        free: queue.Queue[int] = queue.Queue()
        for i in range(self.recv_slots):
            free.put(i)
        work: queue.Queue[tuple[str, int] | None] = queue.Queue()
        errors: list[BaseException] = []
        applied = [0.0]

        def applier() -> None:
            while True:
                item = work.get()
                if item is None:
                    return
                g, s = item
                try:
                    if not errors:
                        ta = time.perf_counter()
                        applied_any[0] = True
                        self.apply(g, self.slots[s])
                        applied[0] += time.perf_counter() - ta
                except BaseException as e:  # surfaces in the pulling thread
                    errors.append(e)
                finally:
                    free.put(s)

        th = threading.Thread(target=applier, name=f"shardsync-apply-{self.id}", daemon=True)
        self._apply_thread = th
        th.start()
        received = 0
        try:
            for g in self.plan.groups:
                if errors:
                    break
                try:
                    s = free.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise TransportError(f"consumer {self.id}: no receive slot freed within {self.timeout_s} s "
                                         f"(applying a group is stuck)") from None
                received += self._pull_group(version, session, g.name, self.slots[s])
                work.put((g.name, s))
        finally:
            work.put(None)
            th.join(timeout=self.timeout_s)
        if errors:
            raise errors[0]
        if th.is_alive():
            raise SyncError(f"consumer {self.id}: applying version {version} did not finish within {self.timeout_s} s")
        self.coord.call(m.Completed(consumer=self.id, session=session, version=version), timeout_s=self.lease_s + 1)
        self.stats.update(version=version, seconds=time.perf_counter() - t0, bytes_received=received,
                          apply_s=applied[0], rejoins=self.rejoins)
        return dict(self.stats)

    def _connect(self, producers: list[dict[str, Any]]) -> None:
        for info in producers:
            p, inc, desc = int(info["rank"]), int(info["incarnation"]), info["desc"]
            if self.peers.get(p) == (inc, desc):
                continue
            old = self.clients.pop(p, None)
            if old is not None:
                old.close()
            try:
                self.clients[p] = m.ControlClient(info["address"], self.token, peer=f"producer {p}",
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

    def _pull_group(self, version: int, session: str, group: str, buf: torch.Tensor) -> int:
        lay = self.layouts[group]
        per_chunk = self.routes[group]
        got = 0
        deadline = time.monotonic() + self.timeout_s
        for p in sorted(set(per_chunk)):
            while True:  # short polls: a stopped producer is noticed within the lease, a slow one waited for
                self._check_peers(p, version, group)
                try:
                    ready = self.clients[p].call(m.WaitReady(consumer=self.id, session=session, version=version,
                                                             group=group), timeout_s=self.lease_s + 1)
                except TransportError as e:
                    raise self._lost(p, version, group, e) from None
                if not isinstance(ready, m.Pending):
                    break
                if time.monotonic() > deadline:
                    raise TransportError(f"consumer {self.id}: producer {p} did not pack group {group!r} of version "
                                         f"{version} within {self.timeout_s} s")
            ready = _expect(ready, m.Ready, f"producer {p}")
            if (ready.version, ready.group) != (version, group):
                raise SyncError(f"consumer {self.id}: producer {p} answered for group {ready.group!r} of version "
                                f"{ready.version}, asked for {group!r} of version {version}")
            mine = {i for i, q in enumerate(per_chunk) if q == p}
            if {c[0] for c in ready.chunks} != mine:
                raise SyncError(f"consumer {self.id}: producer {p} offers chunks {sorted(c[0] for c in ready.chunks)} "
                                f"of group {group!r}, routes say {sorted(mine)}")
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
            try:
                self.clients[p].call(m.Released(consumer=self.id, session=session, version=version, group=group),
                                     timeout_s=self.lease_s + 1)
            except TransportError as e:
                raise self._lost(p, version, group, e) from None
        return got

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
        for c in self.clients.values():
            c.close()
        if hasattr(self, "coord"):
            self.coord.close()
        self.transport.close()
