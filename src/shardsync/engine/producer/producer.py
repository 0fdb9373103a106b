"""Trainer side: gather one weight group at a time, replay + pack, serve pulls, free on release.

What is gathered when, how many groups are resident and when a ring slot is freed are ``engine/schedule.py``'s
rules 1-7; one sync's loop is ``producer_sync.py``. The configuration is ``producer_config.py``; this module holds the
producer's control handler (``WaitReady``, ``Released``, ``Abandon``, answered by its version table; rank 0 also hosts the
coordinator), init and the sync's start and failure. A :class:`Producer` owns its :class:`~.versions.VersionTable`
(the per-version state) and this epoch's :class:`~.units.RingLayout` (units, schedule, ring); each sync is given a
:class:`~.sync_context.SyncContext` naming what it uses:

1. A sync serves the consumers that are members of its version (fixed by the coordinator when the
   version begins: registered, lease live); a member that abandons the version, says goodbye or lets its
   lease expire (``lease_s``: the detection bound) is dropped, and the sync's result names who and why.
2. A straggler — a member whose lease is live but that has not released a group ``straggler_s`` after it was
   announced, nor any other group of this rank in that time (a hung engine worker, a generation the framework did
   not interrupt, a peer that went idle) — is dropped from that version as a dead one is: no ring slot, version
   or healthy engine is held hostage by one member. It stays a member of the group; its late ``WaitReady`` or
   ``Released`` for that version is refused (``ConsumerDropped``: what it read may have been overwritten), so it is
   torn only if it had applied part of the version, and it takes part in the next version.
3. A dead producer (its lease expired) or a version another producer reported failed ends the sync with
   :class:`ProducerLost` / :class:`SyncError`; consumers then keep their previous complete version.
   Every wait is bounded by ``timeout_s`` and names what it waited for. A failure is made known to the
   coordinator (``SyncFailed``) and to every consumer waiting on the version before it is raised.
4. ``sync`` returns the version's outcome, not only this rank's part: once this rank's slots are all
   released it waits until every member has completed the version (all groups, from every producer) or
   been dropped; a version that failed anywhere raises here on every rank.

    producer = Producer(source, ProducerConfig(rank=0, n_producers=2, n_consumers=4, token="t"))
    producer.init()          # blocks until a quorum of consumers registered their plans
    producer.sync(version=1) # returns when every live member released every group of this rank
"""

from __future__ import annotations

import logging
import threading
from contextlib import suppress
from dataclasses import replace
from typing import Any

import torch

from ..protocol import messages as m
from ..protocol.control import ControlClient, ControlServer
from ..coordinator.coordinator import Coordinator
from ..protocol.heartbeat import Heartbeat
from ..lanes import Lane, hot_path
from .lockstep_batches import finish_lockstep
from .producer_config import ProducerConfig
from .producer_sync import ProducerSync
from .snapshot import PendingSync, Snapshot
from .sync_context import SyncContext
from ...security.chunkmac import chunk_key
from ...delta.sender import DeltaSender, area_bytes
from .same_batches import SameBatches
from ..source_reads.source_share import SourceShare
from .units import RELEASED_RING_BYTES, RingLayout, build_units
from .versions import VersionState, VersionTable
from ..protocol.wire import parse_address
from ...errors import SyncError
from ...plan.split import budget_for
from ...source import WeightSource
from ...sources.adapt import adapt
from ...transport import Transport, make_group_transport, transport_caps
from ...types import dtype_of, metadata_digest

log = logging.getLogger("shardsync.producer")


class Producer:
    def __init__(self, source: WeightSource | Any, cfg: ProducerConfig, transport: Transport | None = None):
        self.source, self.cfg = adapt(source), cfg
        self.metas = self.source.metadata()
        self._own_transport = transport is None
        self.transport = transport or self._make_transport()
        self.coordinator = Coordinator(
            metadata=self.metas, n_producers=cfg.n_producers, n_consumers=cfg.n_consumers,
            max_chunk_bytes=cfg.max_chunk_bytes, timeout_s=cfg.timeout_s, init_timeout_s=cfg.init_timeout_s,
            lease_s=cfg.lease_s, min_consumers=cfg.min_consumers, join_grace_s=cfg.join_grace_s,
            max_routed_bytes=cfg.max_routed_bytes, max_group_bytes=cfg.max_group_bytes, mac=cfg.mac) \
            if cfg.rank == 0 else None
        self.server = ControlServer(cfg.host, cfg.port, cfg.token, self._handle, advertise_host=cfg.advertise_host,
                                    max_frame_bytes=cfg.max_frame_bytes, name=f"producer{cfg.rank}", mac=cfg.mac)
        if self.coordinator is not None:  # its init waits name the connections refused for a wrong token
            self.coordinator.refusals = self.server.refusals
        self.address = self.server.address
        self.table = VersionTable(cfg, lease_view=self._lease_view, on_stragglers=self._report_stragglers)
        """The versions this rank serves (``versions.py``): members, packed groups, drops, ``WaitReady`` answers."""
        self.cv = self.table.cv
        self.epoch = -1
        self.same_batches = SameBatches()
        """Per gather batch: the last sync's checks, reused while the source yields the same objects."""
        self.layout: RingLayout | None = None
        """This epoch's units, schedule, ring and delta sender (``units.py``; None before init)."""
        self.heartbeat: Heartbeat | None = None
        self.incarnation, self.credential = -1, ""
        """This rank's incarnation and its secret (``Joined``), from ``init``."""
        self._pending: PendingSync | None = None
        self.stats: dict[str, Any] = {}
        self.lane = Lane(cfg.device)
        wanted = cfg.verify_checksums if cfg.verify_checksums is not None else not (self.lane.cuda or cfg.source_reads)
        self.checksums = wanted and not cfg.mac
        """Whether this rank sends an xxh3 checksum with every chunk (``ProducerConfig.verify_checksums``; None: host
        rings; never with ``mac``, whose tags supersede them)."""
        self.shares = SourceShare.configured(cfg, self.transport, gpu=self.lane.cuda, checksums=self.checksums)
        """Source reads (``ProducerConfig.source_reads``), when on."""
        self.chunk_key = chunk_key(cfg.token) if cfg.mac else None
        """With ``mac``: the key this rank tags its chunks with (derived from the token; never sent or printed)."""
        self._expect = {x.name: (torch.Size(x.shape), dtype_of(x.dtype)) for x in self.metas}
        if self.lane.cuda and not self.transport.caps.gpu:
            raise SyncError(f"producer {cfg.rank}: transport {self.transport.name!r} cannot move GPU memory (ring on "
                            f"{cfg.device}); use cuda_ipc, nccl or nixl")

    # ------------------------------------------------------------------ the version table's and layout's state
    @property
    def versions(self) -> dict[int, VersionState]:
        return self.table.versions

    @property
    def abandoned(self) -> dict[int, dict[str, tuple[str, str]]]:
        return self.table.abandoned

    @property
    def reads_sources(self) -> dict[str, bool]:
        return self.table.reads_sources

    def held_bytes(self) -> int:
        """Ring bytes still referenced by packed chunks some consumer has not released (0 between syncs)."""
        return self.table.held_bytes()

    def straggler_bound(self) -> float:
        """Seconds a member may hold an announced group before it is dropped (``ProducerConfig.straggler_s``)."""
        return self.table.straggler_bound()

    @property
    def ring(self) -> torch.Tensor | None:
        return None if self.layout is None else self.layout.ring

    @property
    def slot_bytes(self) -> int:
        return 0 if self.layout is None else self.layout.slot_bytes

    @property
    def units(self) -> dict[str, list[Any]]:
        return {} if self.layout is None else self.layout.units

    @property
    def schedule(self) -> Any:
        return None if self.layout is None else self.layout.schedule

    @property
    def order(self) -> list[str]:
        return [] if self.layout is None else self.layout.order

    @property
    def delta(self) -> DeltaSender | None:
        return None if self.layout is None else self.layout.delta

    def _make_transport(self) -> Transport:
        """The data plane; the tcp and nccl transports bind where the control plane does, advertise the same address
        and check the group's token (unless ``transport_kwargs`` say otherwise)."""
        kw = dict(self.cfg.transport_kwargs)
        if transport_caps(self.cfg.transport).takes_token:  # a socket data plane: where the control plane listens
            kw.setdefault("host", self.cfg.host)
            kw.setdefault("advertise_host", self.cfg.advertise_host)
        return make_group_transport(self.cfg.transport, token=self.cfg.token, **kw)

    # ------------------------------------------------------------------ control handler
    def _handle(self, msg: m.Msg) -> m.Msg:
        if self.coordinator is not None:
            reply = self.coordinator.handle(msg)
            if reply is not None:
                return reply
        if isinstance(msg, m.WaitReady):
            return self.table.wait_ready(msg)
        if isinstance(msg, m.Released):
            self.table.release(msg)
            return m.Ack()
        if isinstance(msg, m.Abandon):
            self.table.abandon(msg)
            return m.Ack()
        raise SyncError(f"producer {self.cfg.rank}: unexpected message {type(msg).__name__}")

    def _lease_view(self) -> dict[str, Any]:
        """What the coordinator knows of leases (rank 0 hosts it; the others' heartbeats bring its view)."""
        if self.coordinator is not None:
            return self.coordinator.lease_view()
        assert self.heartbeat is not None
        return self.heartbeat.view()

    def _report_stragglers(self, version: int, late: list[tuple[str, str, str]]) -> None:
        """Tell the coordinator of the members just dropped as stragglers, in the background (called with ``cv``
        held) and best effort: without it the other producers still drop the straggler by their own clocks, and the
        outcome waits for it at most ``timeout_s``."""
        msgs = [m.Straggler(rank=self.cfg.rank, incarnation=getattr(self, "incarnation", 0), version=version,
                            consumer=cid, session=session, reason=why, credential=self.credential)
                for cid, session, why in late]
        client, bound = self.client, min(5.0, self.cfg.lease_s + 1)

        def tell() -> None:
            for msg in msgs:
                with suppress(Exception):
                    client.call(msg, timeout_s=bound)

        threading.Thread(target=tell, name=f"shardsync-straggler-p{self.cfg.rank}", daemon=True).start()

    # ------------------------------------------------------------------ init
    def init(self) -> None:
        cfg = self.cfg
        coord = self.address if cfg.rank == 0 else (None if cfg.coordinator is None else parse_address(cfg.coordinator))
        if coord is None:
            raise ValueError(f"producer {cfg.rank} needs the coordinator's address")
        held = self.source.held_names()
        self.client = ControlClient(coord, cfg.token, peer="coordinator (producer 0)",
                                    max_frame_bytes=cfg.max_frame_bytes, require_mac=cfg.mac)
        self._join = m.Join(rank=cfg.rank, address=self.address, held=None if held is None else sorted(held),
                            meta_digest=metadata_digest(self.metas), node=cfg.node, mac=cfg.mac)
        joined = self.client.call(self._join, timeout_s=cfg.init_timeout_s)
        self.incarnation, self.credential = joined.incarnation, joined.credential
        if cfg.rank != 0:
            self.heartbeat = Heartbeat(coord, cfg.token, m.Renew(rank=cfg.rank, incarnation=self.incarnation),
                                       lease_s=cfg.lease_s, who=f"producer {cfg.rank}", on_change=self.table.wake,
                                       on_dropped=self._rejoin, require_mac=cfg.mac)
        self._assign(self.client.call(m.GetAssignments(rank=cfg.rank), timeout_s=cfg.init_timeout_s + 5))
        self.client.call(m.ProducerReady(rank=cfg.rank, incarnation=self.incarnation, version=-1, desc=self.desc),
                         timeout_s=cfg.init_timeout_s)

    def _rejoin(self, why: str) -> None:
        """Our lease lapsed (a pause, a starved process): the sync in flight has failed for everyone; join again
        as a new incarnation with the same ring, so the next sync includes this rank."""
        assert self.heartbeat is not None
        joined = self.client.call(self._join, timeout_s=self.cfg.timeout_s)
        self.incarnation, self.credential = joined.incarnation, joined.credential
        self.heartbeat.set_renew(m.Renew(rank=self.cfg.rank, incarnation=self.incarnation))
        self.client.call(m.ProducerReady(rank=self.cfg.rank, incarnation=self.incarnation, version=-1, desc=self.desc),
                         timeout_s=self.cfg.timeout_s)

    def _assign(self, asg: Any) -> None:
        """Build this rank's units from the coordinator's assignments (at init, and when a rejoiner's new plan
        bumped the epoch); the ring is (re)allocated only if a slot must grow."""
        cfg = self.cfg
        units, schedule, slot = build_units(asg, self.metas, self.source, rank=cfg.rank,
                                            max_chunk_bytes=cfg.max_chunk_bytes)
        if cfg.gather_budget_bytes is not None and schedule.peak_bytes > cfg.gather_budget_bytes:
            b = max(range(len(schedule.batches)), key=lambda i: schedule.batch_bytes[i])
            raise SyncError(f"producer {cfg.rank}: gathering needs up to {schedule.peak_bytes} bytes of full "
                            f"tensors at once (the largest gather group, starting {schedule.batches[b][0]!r}, is "
                            f"{schedule.batch_bytes[b]} bytes), above gather_budget_bytes="
                            f"{cfg.gather_budget_bytes}")
        self.same_batches.reset()  # a new schedule: its batches are checked in full again
        n_slots = cfg.lookahead + 1
        delta = None
        if cfg.delta:  # a delta area beside the dense part of every slot (a share of it: delta/sender.py)
            delta = DeltaSender(units, device=self.lane.device, budget_bytes=cfg.delta_budget_bytes,
                                host=cfg.delta_host_history)
            dense_slot, slot = slot, slot + area_bytes(slot)
        else:
            dense_slot = slot
        old = self.layout
        shrink = old is not None and self._own_transport and slot <= old.slot_bytes // 2  # plans went: give it back
        if old is None or old.released or slot > old.slot_bytes or shrink:
            if old is not None and not self._own_transport:
                raise SyncError(f"producer {cfg.rank}: a new plan needs {slot}-byte ring slots (have "
                                f"{old.slot_bytes}) and the transport was passed in: it cannot be re-registered")
            self.layout = None  # the old ring goes before the new one is allocated
            del old
            ring, slot_bytes = self._new_ring(n_slots * slot), slot
        else:
            ring, slot_bytes = old.ring, old.slot_bytes
        self.layout = RingLayout(
            units=units, schedule=schedule, ring=ring, n_slots=n_slots, slot_bytes=slot_bytes, dense_slot=dense_slot,
            delta=delta, unit_sources={g: sorted(frozenset().union(*(u.sources for u in us))) for g, us in units.items()})
        if delta is not None:
            delta.area = slot_bytes - dense_slot  # a kept ring's slots may be larger than this plan's
        self.epoch = asg.epoch
        budget = budget_for(self.metas, cfg.sync_memory_bytes)
        if budget and ring.numel() > budget:  # plans recorded unsplit, or many distinct plans of one group
            log.warning("producer %d: its ring holds %d bytes (%d slots of %d), above sync_memory_bytes=%d: a "
                        "plan was recorded unsplit, one tensor slice is larger than half the budget, or distinct "
                        "plans add up in one group", cfg.rank, ring.numel(), n_slots, slot_bytes, budget)
        self.stats = {"rank": cfg.rank, "groups": len(schedule.order), "slot_bytes": slot_bytes,
                      "ring_bytes": ring.numel(), "ring_released": False, "sync_memory_bytes": budget, "gather_batches": len(schedule.batches),
                      "planned_peak_gathered_bytes": schedule.peak_bytes,
                      **(delta.stats() if delta is not None else {})}

    def _new_ring(self, nbytes: int) -> torch.Tensor:
        """A ring of ``nbytes`` registered as this rank's descriptor. A ring registered before is retired first
        (``Transport.retire``): the transport and the storages it shared stay, so consumers keep their mapped source
        tensors and only reconnect to the ring; a transport that cannot retire goes with it, and a new one (with
        source shares on it) is made (the callers check that the transport is this rank's own)."""
        retire = getattr(self.transport, "retire", None)
        if hasattr(self, "desc") and not (retire is not None and retire(self.desc)):
            self.transport.close()
            self.transport = self._make_transport()
            if self.shares is not None:  # descriptors of the old transport's shares are gone with it
                self.shares = SourceShare.configured(self.cfg, self.transport, gpu=self.lane.cuda,
                                                     checksums=self.checksums)
        ring = torch.zeros(max(nbytes, RELEASED_RING_BYTES), dtype=torch.uint8, device=self.lane.device)
        self.desc = self.transport.register(ring)
        return ring

    def _release_ring(self) -> None:
        """After a version that served every group of this rank from the trainer's tensors (source reads: every
        member maps them), the ring is let go — a 64-byte stand-in keeps a descriptor — until a version needs it
        again (:meth:`_ring_for`). A transport passed in, or one group packed, keeps it."""
        lay = self.layout
        if lay is None or lay.released or self.shares is None or not self._own_transport or lay.delta is not None \
                or not lay.order or not lay.by_source.issuperset(lay.order):
            return
        del lay
        self._swap_ring(0, released=True)
        self.stats.update(ring_released=True)
        log.info("producer %d: every group was served from the trainer's tensors: ring released", self.cfg.rank)

    def _ring_for(self, st: VersionState) -> None:
        """At a version's start: a released ring comes back when a member might need packed groups (it did not say
        it maps this rank's memory, or the last version packed a group)."""
        lay = self.layout
        if lay is None or not lay.released:
            return
        if st.members and all(self.table.reads_sources.get(c) for c in st.members) \
                and lay.by_source.issuperset(lay.order):
            return
        nbytes = lay.n_slots * lay.slot_bytes
        del lay
        self._swap_ring(nbytes, released=False)
        self.stats.update(ring_released=False)

    def _area_for(self) -> None:
        """At a version's start, with delta sync: the slots' delta areas sized by the last completed version
        (``DeltaSender.area_for``), the ring swapped on the same transport where they change. A transport passed
        in cannot be re-registered: its areas stay as first allocated."""
        lay = self.layout
        if lay is None or lay.delta is None or lay.released or not self._own_transport:
            return
        area = lay.delta.area_for(lay.dense_slot)
        if area is None or area == lay.slot_bytes - lay.dense_slot:
            return
        slot, nbytes, delta = lay.dense_slot + area, lay.n_slots * (lay.dense_slot + area), lay.delta
        del lay
        ring = self._swap_ring(nbytes, slot_bytes=slot)
        delta.area = area
        self.stats.update(slot_bytes=slot, delta_area_bytes=area)
        log.info("producer %d: delta areas of %d bytes a slot (ring %d bytes)", self.cfg.rank, area, ring.numel())

    def _swap_ring(self, nbytes: int, **changes: Any) -> torch.Tensor:
        """The ring replaced by a new one of ``nbytes`` (:meth:`_new_ring`; released, brought back or resized), the
        layout's other fields changed as given. The layout lets go of the old ring first (the transport holds it
        until it retires it); returns the new one."""
        lay = replace(self.layout, ring=torch.empty(0, dtype=torch.uint8))
        self.layout = None
        ring = self._new_ring(nbytes)
        self.layout = replace(lay, ring=ring, **changes)
        self.stats.update(ring_bytes=ring.numel())
        return ring

    # ------------------------------------------------------------------ sync
    def sync(self, version: int, *, block: bool = True) -> "dict[str, Any] | PendingSync":
        """Serve one weight version to its live members; returns the version's outcome and this rank's stats
        (bytes sent, seconds, gathered bytes, ``completed``, ``dropped``: consumer -> why). A failure here is made
        known to every consumer waiting on this version, and to the coordinator, before it is re-raised.

        ``block=False`` (asynchronous RL): the lockstep gathers run now, in this thread, and the tensors this rank
        serves are copied aside (a snapshot costing ``stats["snapshot_bytes"]``: the full tensors routed here,
        refused if above ``gather_budget_bytes``); serving then runs in the background and training may go on
        and change the weights. Returns a :class:`PendingSync`; the next ``sync`` (or ``close``) waits for it."""
        self.wait_pending()
        st: VersionState | None = None
        try:
            try:
                st = self._begin(version)
            except BaseException as e:  # schedule rule 1: fail the version for all, then still run the gathers
                self._fail(version, None, e)
                finish_lockstep(iter(self.source.iter_groups()))
                raise
            ctx = self._sync_context()
            if block:
                with hot_path(self.cfg.switch_interval_s):
                    out = ProducerSync(ctx, version, st, self.source).run()
                self._release_ring()
                return {**out, "ring_bytes": self.stats["ring_bytes"], "ring_released": self.layout.released}
            assert ctx.layout is not None
            snap = Snapshot(self.source, ctx.layout.schedule, self.metas, version=version, rank=self.cfg.rank,
                            budget_bytes=self.cfg.gather_budget_bytes)
            pending = PendingSync(version)

            def serve() -> None:
                try:
                    with hot_path(self.cfg.switch_interval_s):
                        pending.finish(ProducerSync(ctx, version, st, snap, snapshot_bytes=snap.nbytes).run())
                except BaseException as e:
                    self._fail(version, st, e)
                    pending.finish(error=e)

            self._pending = pending
            pending.start(serve)
            return pending
        except BaseException as e:
            if not getattr(e, "_shardsync_reported", False):
                self._fail(version, st, e)
            raise

    def _sync_context(self) -> SyncContext:
        """What one sync is given (this epoch's layout: after ``_begin``)."""
        assert self.layout is not None
        return SyncContext(cfg=self.cfg, table=self.table, layout=self.layout, lane=self.lane,
                           same_batches=self.same_batches, shares=self.shares, checksums=self.checksums,
                           chunk_key=self.chunk_key, expect=self._expect, metas=self.metas, stats=self.stats,
                           source_stats=lambda: dict(getattr(self.source, "stats", None) or {}),
                           fail=self._fail, drain=self._drain, poll_outcome=self._poll_outcome)

    def wait_pending(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Wait for a non-blocking sync still serving (re-raising its failure); None if there is none."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is None:
            return None
        return pending.result(self.cfg.timeout_s * 2 if timeout_s is None else timeout_s)

    def _begin(self, version: int) -> VersionState:
        quick = min(self.cfg.timeout_s, 2 * self.cfg.lease_s + 1)  # answered at once: a silent coordinator is lost
        view = self.client.call(m.BeginSync(version=version, rank=self.cfg.rank, incarnation=self.incarnation),
                                timeout_s=quick)
        if view.epoch != self.epoch:
            self._assign(self.client.call(m.GetAssignments(rank=self.cfg.rank), timeout_s=self.cfg.timeout_s))
        digests = {u.digest for us in self.units.values() for u in us}
        st = self.table.begin(version, {c: (d, s) for c, (d, s) in view.members.items() if d in digests},
                              incarnations={int(p["rank"]): int(p["incarnation"]) for p in view.producers})
        self._ring_for(st)  # before ProducerReady: the descriptor it sends is this version's
        self._area_for()
        self.client.call(m.ProducerReady(rank=self.cfg.rank, incarnation=self.incarnation, version=version,
                                         desc=self.desc), timeout_s=quick)
        return st

    def _poll_outcome(self, version: int) -> m.Outcome:
        """One look at the version's outcome: rank 0 asks its coordinator, the others ask it over the wire."""
        if self.coordinator is not None:
            return self.coordinator.outcome(version, min(1.0, self.cfg.lease_s / 4))
        return self.client.call(m.AwaitVersion(rank=self.cfg.rank, incarnation=self.incarnation, version=version),
                                timeout_s=self.cfg.lease_s + 1)

    def _fail(self, version: int, st: VersionState | None, e: BaseException) -> None:
        why = f"{type(e).__name__}: {e}"
        self.table.fail(st, why)
        if getattr(e, "_shardsync_reported", False):
            return
        with suppress(Exception):  # within a lease: the coordinator may be what failed (stopped: it would not answer)
            self.client.call(self.sync_failed(version, why), timeout_s=min(5.0, self.cfg.lease_s + 1))
        with suppress(Exception):
            e._shardsync_reported = True  # type: ignore[attr-defined]

    def sync_failed(self, version: int, why: str) -> m.SyncFailed:
        """The message that fails ``version`` for every rank, proven by this incarnation's credential."""
        return m.SyncFailed(rank=self.cfg.rank, version=version, reason=why, incarnation=self.incarnation,
                            credential=self.credential)

    def _drain(self, timeout_s: float = 5.0) -> None:
        """Let the replies to releases already handled go out before returning (a ``close()`` or the trainer
        exiting right after ``sync`` must not cut a consumer's last ``Released`` short)."""
        self.server.wait_answered("Released", "Abandon", "Completed", timeout_s=timeout_s)

    def close(self) -> None:
        with suppress(Exception):  # already reported to the coordinator and the consumers; not raised again
            self.wait_pending()
        self._drain()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.server.close()
        self.transport.close()
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
