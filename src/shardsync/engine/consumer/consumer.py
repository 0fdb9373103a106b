"""Inference side: record the plan, learn the routes, pull chunks, apply groups in the background.

How a sync's pulls and applies overlap (pullers, receive slots, the applier) is ``engine/schedule.py``'s
rules 8-10; the threads are ``puller.py``'s :class:`Puller` (one per producer) and ``applier.py``'s
:class:`Applier`. They see this consumer only through the :class:`~.pullcontext.PullContext` it builds at ``init``,
and each producer's chunks land in the chunk sink chosen for it when a sync starts (``chunksinks.py``: a receive
slot, its mapped ring, the delta held copy; source reads around each). The consumer's protocol:

1. ``init``: ``Hello`` (session credential; the lease starts and a heartbeat keeps it), record the
   plan, allocate the receive slots, ``RegisterPlan`` (routes). A failure to start is reported
   (``InitFailed``) before it is raised.
2. Each sync starts with ``BeginSync``: this consumer must be a member of the version, and learns the
   current address and transport descriptor of the producers it pulls from (a restarted producer is
   reconnected here); it ends with ``Completed`` once every group has been applied.
3. A producer that dies or stops answering is detected within the lease bound (its connection breaks,
   a poll is not answered, or the coordinator reports it dead): :class:`ProducerLost`. Any failure —
   or a version this engine rejects — is sent to the producers (``Abandon``) before it is raised, so
   nobody waits for this consumer. ``torn`` says whether a failed sync had already applied groups (the
   engine then holds a mix and must not serve until a later sync completes); ``version`` is the last
   complete one.
4. If the lease expires (the process was paused), the heartbeat rejoins with the same plan and a new
   session: the next version is received in full — unless another session took this consumer's id meanwhile (a
   restarted engine replaced this paused one): then this session is *displaced*. It never rejoins by itself (its
   replacement may die later: a rejoin then would make an undriven member of every version); it logs one warning,
   its heartbeat stops, and ``sync`` raises :class:`ConsumerDisplaced` (re-initialise it to serve again).

    consumer = Consumer("r0/tp1", coordinator_address, token="t", record=record_fn, apply=apply_fn)
    consumer.init()          # Hello -> record plan -> RegisterPlan -> Routes
    consumer.sync(version=1)
"""

from __future__ import annotations

import logging
import threading
import time
from ...config import GroupSettings, split_settings
from typing import Any, Callable, Sequence

import torch

from ..protocol import messages as m
from .applier import Applier
from .chunksinks import choose_sink
from .pullcontext import PullContext, producer_lost
from .recvslots import SlotPool
from ...security.chunkmac import chunk_key
from ..protocol.control import ControlClient
from ..protocol.heartbeat import Heartbeat
from ..lanes import Lane, hot_path
from ...delta.receiver import HeldChunks
from .puller import Puller, PullRound, SerialPuller
from ..source_reads.source_open import SourceOpener
from ..protocol.wire import parse_address
from ..coordinator.membership import Membership
from ...errors import ConsumerDropped, SessionInUse, SyncError, TransportError
from ...plan.pack import GroupLayout
from ...plan.route import chunk_layouts, holders_from_ownership
from ...transport import Transport, make_group_transport
from ...types import ParamMeta, Plan

RecordFn = Callable[[Sequence[ParamMeta]], Plan]
ApplyFn = Callable[[str, torch.Tensor], None]
log = logging.getLogger("shardsync.consumer")


class ConsumerDisplaced(ConsumerDropped):
    """This consumer's session was dropped (its lease lapsed: the process was paused or cut off) and another session
    took its consumer id (a restarted engine): it does not rejoin by itself and must be re-initialised."""


class Consumer:
    def __init__(self, consumer_id: str, coordinator: list[Any] | str, *, record: RecordFn, apply: ApplyFn,
                 settings: GroupSettings | None = None, recv_slots: int = 4, recv_budget_bytes: int | None = None,
                 parallel_producers: bool = True, device: str | None = None, node: str = "",
                 direct_reads: bool | None = None, read_back: Callable[[Plan], Any] | None = None, **group: Any):
        """``settings``: the group's (``config.GroupSettings``); ``group``: any of its fields by keyword (on top of
        ``settings``; old names such as ``require_mac`` accepted). ``transport`` may also be a ``Transport``."""
        found, unknown = split_settings(group, where=f"Consumer {consumer_id!r}", base=settings)
        if unknown:
            raise TypeError(f"Consumer {consumer_id!r}: unknown keyword argument(s) {sorted(unknown)[:8]}")
        self.settings = found
        """The group settings this consumer runs with."""
        token, transport, transport_kwargs = found.token, found.transport, found.transport_kwargs
        timeout_s, init_timeout_s, max_frame_bytes = found.timeout_s, found.init_timeout_s, found.max_frame_bytes
        verify_checksums, require_mac, delta = found.verify_checksums is True, found.mac, found.delta
        switch_interval_s = found.switch_interval_s
        self.id, self.coordinator, self.token = consumer_id, parse_address(coordinator), token
        self.record, self.apply = record, apply
        self.transport = transport if not isinstance(transport, str) else \
            make_group_transport(transport, token=token, **dict(transport_kwargs or {}))
        self.timeout_s, self.recv_slots, self.init_timeout_s = timeout_s, recv_slots, init_timeout_s
        self.recv_budget_bytes = recv_budget_bytes
        """Receive memory cap: ``recv_slots`` is lowered to fit it (at least 2 slots of the largest group)."""
        self.parallel_producers = parallel_producers
        """False: one puller, group by group in transfer order, each group's producers one after the other (PP
        stages served serially; kept as the reference the benchmark compares against)."""
        self.verify_checksums, self.max_frame_bytes = verify_checksums, max_frame_bytes
        self.require_mac = require_mac
        """Refuse producers that do not run with ``ProducerConfig.mac`` (AuthError at their handshake) and chunks
        without a keyed tag (ChunkMacError). Without it, tags are still checked wherever they come, and demanded
        once the coordinator's connection turns out MACed (its group runs with mac)."""
        self.chunk_key = chunk_key(token)
        """The group's chunk key (derived from the token; never sent or printed)."""
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
        self.direct_reads = direct_reads
        """Copy a group straight from a producer's ring into the parameters when the transport maps that ring into
        this process on this consumer's device (``cuda_ipc`` colocated; ``loopback``): one memory pass and no
        receive slot for that producer, which is released once the group is applied. ``apply`` then gets a
        :class:`~shardsync.plan.pack.ChunkParts` (every ``GroupUnpacker`` takes both). None: on for GPU consumers,
        False: always through receive slots."""
        if self.lane.cuda and not self.transport.caps.gpu:
            raise SyncError(f"consumer {consumer_id}: transport {self.transport.name!r} cannot move GPU memory "
                            f"(receive slots on {device}); use cuda_ipc, nccl or nixl")
        self.delta = delta
        """Delta sync (``delta/receiver.py``, ``GroupSettings.delta``): keep a held copy of this consumer's packed
        chunks (its plan's packed bytes, on its device: ``stats["delta_held_bytes"]``; allocated at the first sync
        that reads some producer's deltas) and read only the changed words where a producer offers them against the
        version held. With ``True`` a producer whose ring this consumer maps on its own device is read dense,
        directly (memory speed beats decoding); ``"always"`` reads every producer's deltas."""
        self.read_back = read_back
        """Delta sync into an engine that writes some parameters as they come (no processing after the copy):
        ``read_back(plan)`` gives what can be read back of them (``plan/readback.ParamsReadBack``: ``readable``
        scatters, ``read_back(group, chunk, dst)``), or None. Those chunks keep no held copy: a delta's base is packed
        again from the parameters, into a receive slot (``delta/receiver.py``, live chunks)."""
        self.sources: SourceOpener | None = None
        """Source reads (``engine/source_reads/source_open.py``): the producers' tensors mapped here, when the transport can."""
        self.held: HeldChunks | None = None
        self.stats: dict[str, Any] = {}
        self.version = 0
        """The last version this consumer completed."""
        self.torn = False
        """A failed sync applied some groups: the engine holds a mix of versions until a sync completes."""
        self.rejoins = 0
        self.displaced = ""
        """Why this session was displaced (another session took its id), else "": it neither renews nor rejoins."""
        self.heartbeat: Heartbeat | None = None
        self.clients: dict[int, ControlClient] = {}
        self.rclients: dict[int, ControlClient] = {}  # releases: a second connection per producer
        self.peers: dict[int, tuple[int, Any]] = {}  # producer -> (incarnation, desc) connected
        self._lock = threading.Lock()  # session changes (rejoin) vs. a sync reading it
        self._displace_lock = threading.Lock()  # said once, whichever thread learns it first
        self._applier: Applier | None = None  # the last sync's

    # ------------------------------------------------------------------ init / rejoin
    def init(self) -> Plan:
        t0 = time.perf_counter()
        peer = "coordinator (producer 0)"
        self.coord = ControlClient(self.coordinator, self.token, peer=peer, max_frame_bytes=self.max_frame_bytes,
                                   require_mac=self.require_mac)
        w = self._hello(peer)
        self.session, self.lease_s = w.session, w.lease_s
        self.heartbeat = Heartbeat(self.coordinator, self.token, m.Renew(consumer=self.id, session=self.session),
                                   lease_s=w.lease_s, who=f"consumer {self.id}", on_dropped=self._on_dropped,
                                   require_mac=self.require_mac)
        try:
            self.metas = [ParamMeta.from_dict(d) for d in w.metadata]
            self.sources = SourceOpener(self.transport, self.metas, who=f"consumer {self.id}") \
                if self.transport.caps.shares_memory else None
            self.plan = self.record(self.metas)
            if self.delta and self.lane.cuda:  # the delta checks' kernels compiled now, not in the first delta sync
                HeldChunks.warm(self.lane.device)
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
            self._slot_shape = (n, slot)
            self.held = None  # a new plan's layouts: a held copy is made for them when a sync needs one
            self.slots: list[torch.Tensor] = []
            """Receive slots, allocated at the first sync that reads some producer through them."""
            routes = m.expect(self.coord.call(m.RegisterPlan(consumer=self.id, session=self.session,
                                                             plan=self.plan.to_json(), node=self.node),
                                              timeout_s=self.init_timeout_s + 5), m.Routes, peer)
            self.routes = routes.routes
            self.pulls = PullContext(id=self.id, transport=self.transport, timeout_s=self.timeout_s,
                                     lease_s=self.lease_s, chunk_key=self.chunk_key,
                                     verify_checksums=self.verify_checksums, mac_required=self._mac_required,
                                     lane=self.lane, plan=self.plan, layouts=self.layouts, clients=self.clients,
                                     rclients=self.rclients, peers=self.peers, peer_view=self.heartbeat.view)
            """What this session's pullers, chunk sinks and applier see of it."""
        except BaseException as e:  # tell the coordinator now: init must not wait for this consumer
            try:
                why = m.clip(f"{type(e).__name__}: {e}")
                self.coord.call(m.InitFailed(consumer=self.id, session=self.session, reason=why), timeout_s=5)
            except Exception:
                pass
            self.heartbeat.stop()
            raise
        self.stats = {"consumer": self.id, "init_s": time.perf_counter() - t0, "plan_bytes": self.plan.nbytes,
                      "producers": sorted({p for per in self.routes.values() for p in per})}
        return self.plan

    def _mac_required(self) -> bool:
        """Chunks must carry a keyed tag: ``require_mac``, or the coordinator's connection is MACed (its group runs
        with mac)."""
        return self.require_mac or self.coord.macs

    def _hello(self, peer: str) -> m.Welcome:
        """``Hello``; while a predecessor under this id (a killed engine) still holds a live lease, ask again until
        it lapses (the coordinator's re-admission rule; at most a lease)."""
        deadline = time.monotonic() + self.init_timeout_s
        while True:
            try:
                return m.expect(self.coord.call(m.Hello(consumer=self.id), timeout_s=self.init_timeout_s + 5),
                                m.Welcome, peer)
            except SessionInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _on_dropped(self, why: str) -> None:
        """The heartbeat's renewal was refused: rejoin, unless displaced (then stop: said once, by ``_displace``)."""
        refused = self.heartbeat.refused if self.heartbeat is not None else None
        try:
            self._rejoin(why, refused=None if refused is None else refused.session)
        except ConsumerDisplaced:
            pass

    def _displace(self, why: str) -> ConsumerDisplaced:
        """Another session holds (or held) this id since ours was dropped: stop for good (one warning)."""
        with self._displace_lock:
            if self.displaced:
                return ConsumerDisplaced(self.displaced)
            self.displaced = (f"consumer {self.id}: this session was displaced by another session under its id while "
                              f"it was paused or cut off ({why}); it does not rejoin by itself: re-initialise it "
                              "(a new Consumer, or init_weight_transfer_engine) to serve again")
        log.warning("%s", self.displaced)
        if self.heartbeat is not None:
            self.heartbeat.stop(wait=False)  # maybe from its own thread, or while it waits for this rejoin's lock
        return ConsumerDisplaced(self.displaced)

    def _rejoin(self, why: str, *, refused: str | None = None) -> None:
        """Our lease expired (we were paused or cut off): join again with the plan we have — unless another session
        took our id meanwhile (the coordinator says so, or a live session holds it): :class:`ConsumerDisplaced`.
        ``refused``: the session whose renewal was refused (a refusal of an older one is stale: nothing to do)."""
        with self._lock:
            if self.displaced:
                raise ConsumerDisplaced(self.displaced)
            if refused is not None and refused != self.session:
                return
            if Membership.DISPLACED in why:
                raise self._displace(why)
            try:
                w = m.expect(self.coord.call(m.Hello(consumer=self.id, session=self.session),
                                             timeout_s=self.timeout_s), m.Welcome, "coordinator")
            except SessionInUse as e:  # a live session holds our id: we were replaced
                raise self._displace(str(e)) from None
            except ConsumerDropped as e:
                if Membership.DISPLACED in str(e):
                    raise self._displace(str(e)) from None
                raise
            r = m.expect(self.coord.call(m.RegisterPlan(consumer=self.id, session=w.session, plan=self.plan.to_json(),
                                                        node=self.node),
                                         timeout_s=self.timeout_s), m.Routes, "coordinator")
            self.session, self.routes = w.session, r.routes
            assert self.heartbeat is not None
            self.heartbeat.set_renew(m.Renew(consumer=self.id, session=w.session))
            self.rejoins += 1

    # ------------------------------------------------------------------ sync
    def _begin(self, version: int, session: str) -> m.SyncView:
        """``BeginSync``, asked again while the producers start the version (each answer within a lease, so a
        stopped or lost coordinator fails this within the lease bound, not after ``timeout_s``)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self.coord.call(m.BeginSync(version=version, consumer=self.id, session=session),
                                    timeout_s=2 * self.lease_s + 1)
            if not isinstance(reply, m.Pending):
                return m.expect(reply, m.SyncView, "coordinator (producer 0)")
            if time.monotonic() > deadline:
                raise TransportError(f"consumer {self.id}: the producers did not start version {version} within "
                                     f"{self.timeout_s} s")

    def abandon(self, version: int, reason: str, *, lost_producer: int = -1) -> None:
        """Leave ``version`` (this engine rejected or failed it): no producer waits for us. Best effort."""
        msg = m.Abandon(consumer=self.id, session=self.session, version=version, reason=m.clip(reason),
                        lost_producer=lost_producer)
        def tell(c: ControlClient) -> None:
            try:
                c.call(msg, timeout_s=2)
            except Exception:
                pass

        # all at once, 2 s in all: a stopped coordinator (or producer) must not delay this failure once per peer
        threads = [threading.Thread(target=tell, args=(c,), daemon=True) for c in [self.coord, *self.clients.values()]]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 2.5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def sync(self, version: int) -> dict[str, Any]:
        if self.displaced:
            raise ConsumerDisplaced(self.displaced)
        if self._applier is not None and self._applier.is_alive():
            raise SyncError(f"consumer {self.id}: the previous sync's apply thread is still running; this consumer "
                            "must be re-initialised before it syncs again")
        self._applier = None
        if version <= self.version:
            why = f"version {version} is not newer than the version it holds ({self.version})"
            self.abandon(version, why)
            raise SyncError(f"consumer {self.id}: {why}")
        if self.heartbeat is not None and self.heartbeat.dropped:
            self._rejoin(self.heartbeat.dropped)
        if self.held is not None:
            self.held.begin()
        try:
            with hot_path(self.switch_interval_s):
                stats = self._sync(version)
        except BaseException as e:
            if self.held is not None:  # what this sync wrote is no delta base
                self.held.fail()
            self.torn = self.torn or (self._applier is not None and self._applier.applied_any)
            if isinstance(e, ConsumerDropped) and Membership.DISPLACED in str(e):  # the coordinator said so first
                raise self._displace(str(e)) from None
            self.abandon(version, f"{type(e).__name__}: {e}", lost_producer=getattr(e, "producer", -1))
            raise
        self.version, self.torn = version, False
        if self.held is not None:
            self.held.commit(version)
        return stats

    def _sync(self, version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self._lock:
            session = self.session
        try:
            view = self._begin(version, session)
        except ConsumerDropped as e:  # evicted (a lapsed lease) and the heartbeat has not said so yet: rejoin now,
            if Membership.DISPLACED in str(e):  # so this version still includes us if it has not begun
                raise
            self._rejoin(str(e), refused=session)
            with self._lock:
                session = self.session
            view = self._begin(version, session)
        self._connect(view.producers)
        routes = self.routes
        producers = sorted({p for per in routes.values() for p in per})
        direct = self._direct(producers) if self.delta != "always" else {}
        via_ring = [p for p in producers if p not in direct]  # read through receive slots, or as deltas
        if self.delta and via_ring and self.held is None:
            rb = self.read_back(self.plan) if self.read_back is not None else None
            self.held = HeldChunks(self.layouts, device=self.lane.device, read_back=rb)
            self.held.begin()
        if not self.slots and via_ring and (not self.delta or self.held is not None and self.held.live):
            n, size = self._slot_shape
            self.slots = [torch.empty(size, dtype=torch.uint8, device=self.lane.device) for _ in range(n)]
        ctx = self.pulls
        slots = SlotPool(self.slots, [g.name for g in self.plan.groups], timeout_s=self.timeout_s) \
            if self.slots else None
        sinks = {p: choose_sink(ctx, p, version, ring=direct.get(p), slots=slots,
                                held=self.held if p not in direct else None, opener=self.sources)
                 for p in producers}  # each producer's read path, chosen once for this sync
        rnd = PullRound(ctx, version, session, routes, sinks, slots)
        applier = self._applier = Applier(ctx, rnd, self.apply)
        applier.start()
        pullers: list[Puller | SerialPuller] = [Puller(ctx, rnd, p) for p in rnd.serving] \
            if self.parallel_producers else [SerialPuller(ctx, rnd)]
        try:
            for t in pullers:
                t.start()
            for t in pullers:  # every wait inside a puller is bounded (timeout_s, the lease, each read's deadline)
                while t.is_alive() and not rnd.failing.is_set():
                    t.join(0.25)
            if rnd.failing.is_set():  # failed: the others stop at their next check; never wait past the lease
                for t in pullers:
                    t.join(timeout=self.lease_s)
        finally:
            finished = applier.finish(timeout_s=self.timeout_s)
            rnd.finish_releases(self.lease_s + 1)
        rnd.raise_first()
        if not finished:
            raise SyncError(f"consumer {self.id}: applying version {version} did not finish within {self.timeout_s} s")
        self.coord.call(m.Completed(consumer=self.id, session=session, version=version), timeout_s=self.lease_s + 1)
        if self.sources is not None:
            self.sources.prune()
        self.stats.update(version=version, seconds=time.perf_counter() - t0, bytes_received=rnd.received,
                          apply_s=applier.seconds, rejoins=self.rejoins, recv_slots_used=rnd.slots.max_in_use if rnd.slots is not None else 0,
                          recv_bytes=sum(x.numel() for x in self.slots), pulled_from=sorted(rnd.serving),
                          direct_from=sorted(direct), source_groups=rnd.sourced,
                          delta_from=sorted(p for p, k in sinks.items() if k.takes_deltas),
                          transports={p: getattr(self.transport, "chosen", {}).get(p, self.transport.name)
                                      for p in rnd.serving}, ready_wait_s=rnd.ready_wait_s, read_s=rnd.read_s,
                          **(self.held.stats() if self.held is not None else {}))
        return dict(self.stats)

    def _direct(self, producers: list[int]) -> dict[int, Any]:
        """Producer -> its ring mapped into this process, for those read directly (``direct_reads``): the transport
        offers a view and it lies on this consumer's device (a copy across devices would run per tensor)."""
        view = getattr(self.transport, "view", None)
        if self.direct_reads is False or view is None or (self.direct_reads is None and not self.lane.cuda):
            return {}
        out = {}
        for p in producers:
            v = view(p)
            if v is not None and v.device == self.lane.device:
                out[p] = v
        return out

    def _connect(self, producers: list[dict[str, Any]]) -> None:
        for info in producers:
            p, inc, desc = int(info["rank"]), int(info["incarnation"]), info["desc"]
            had = self.peers.get(p)
            if had == (inc, desc):
                continue
            if had is not None and had[0] == inc:  # the same producer swapped its ring: only the data plane reconnects
                try:
                    self.transport.connect(p, desc)
                except TransportError as e:
                    raise producer_lost(self.id, p, -1, "", e) from None
                self.peers[p] = (inc, desc)
                continue
            for old in (self.clients.pop(p, None), self.rclients.pop(p, None)):
                if old is not None:
                    old.close()
            try:
                mac = self.require_mac or self.coord.macs  # a group with mac MACs every rank's frames
                self.clients[p] = ControlClient(info["address"], self.token, peer=f"producer {p}",
                                                connect_timeout_s=self.lease_s, require_mac=mac)
                self.rclients[p] = ControlClient(info["address"], self.token, peer=f"producer {p}",
                                                 connect_timeout_s=self.lease_s, require_mac=mac)
                self.transport.connect(p, desc)
            except TransportError as e:
                raise producer_lost(self.id, p, -1, "", e) from None
            self.peers[p] = (inc, desc)

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
        self.sources = None  # the producers' mapped tensors are let go before the transport closes
        self.transport.close()

