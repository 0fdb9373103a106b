"""Trainer side: gather one weight group at a time, replay + pack, serve pulls, free on release.

The sync schedule (the only place its rules live):

1. Groups are served in transfer order (pre, layers, post), only those this rank routes to someone.
2. A group is gathered (``source.gather``) only when one of ``lookahead + 1`` ring slots is free; its
   full tensors are dropped as soon as its chunks are packed, so at most ``lookahead + 1`` groups are
   ever resident (gathered or packed-and-unreleased). ``stats["max_resident"]`` proves it.
3. Gathering and packing group g+1 overlaps the consumers' pulls of group g (they pull as soon as
   ``Ready`` says so; this thread moves on to g+1).
4. Each distinct plan's chunks are packed once; every consumer sharing that plan (the same rank of
   different replicas) pulls the same bytes.
5. A slot is freed when every consumer routed to it has sent ``Released`` (or has said ``Goodbye``).
   Every wait is bounded by ``timeout_s`` and names what it waited for.

    producer = Producer(source, ProducerConfig(rank=0, n_producers=2, n_consumers=4, token="t"))
    producer.init()          # blocks until consumers registered their plans
    producer.sync(version=1) # returns when every consumer released every group of this rank
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from . import control as m
from .coordinator import Coordinator
from ..errors import SyncError, TransportError
from ..plan.groups import group_order
from ..plan.pack import DEFAULT_CHUNK_BYTES, Chunk, GroupPacker, _align
from ..plan.route import chunk_layouts, holders_from_ownership
from ..source import WeightSource, check_tensor
from ..transport import Transport, make_transport
from ..types import Plan, metadata_digest


@dataclass
class ProducerConfig:
    rank: int
    n_producers: int
    n_consumers: int
    token: str
    host: str = "127.0.0.1"
    port: int = 0
    """Control port; rank 0's is the coordinator address consumers are given."""
    coordinator: list[Any] | None = None
    """Address of rank 0's control server (ranks > 0)."""
    transport: str = "tcp"
    transport_kwargs: dict[str, Any] = field(default_factory=dict)
    lookahead: int = 1
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout_s: float = 120.0
    """Bound on every wait during a sync (a dead consumer surfaces within it)."""
    init_timeout_s: float = 600.0
    """Bound on init waits (peers start engines, record and validate plans: slower than a sync)."""


@dataclass
class _Unit:
    """One chunk of one plan's group that this producer packs and serves (fixed at init)."""

    digest: str
    chunk: Chunk
    slot_offset: int  # offset inside a ring slot
    packer: GroupPacker
    sources: frozenset[str]  # checkpoint names the chunk's slices come from


class Producer:
    def __init__(self, source: WeightSource, cfg: ProducerConfig, transport: Transport | None = None):
        self.source, self.cfg = source, cfg
        self.metas = source.metadata()
        self.transport = transport or make_transport(cfg.transport, **cfg.transport_kwargs)
        self.coordinator = Coordinator(metadata=self.metas, n_producers=cfg.n_producers, n_consumers=cfg.n_consumers,
                                       max_chunk_bytes=cfg.max_chunk_bytes, timeout_s=cfg.init_timeout_s) \
            if cfg.rank == 0 else None
        self.server = m.ControlServer(cfg.host, cfg.port, cfg.token, self._handle)
        self.address = self.server.address
        self.cv = threading.Condition()
        self.ready: dict[tuple[int, str], dict[str, list[list[int]]]] = {}
        self.pending: dict[tuple[int, str], set[str]] = {}
        self.gone: set[str] = set()
        self.failed: dict[int, str] = {}
        self.stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ control handler
    def _handle(self, msg: m.Msg) -> m.Msg:
        if self.coordinator is not None:
            reply = self.coordinator.handle(msg)
            if reply is not None:
                return reply
        if isinstance(msg, m.WaitReady):
            key = (msg.version, msg.group)
            plan_digest = self.consumer_plan.get(msg.consumer)
            if plan_digest is None:
                raise SyncError(f"producer {self.cfg.rank}: unknown consumer {msg.consumer!r}")
            if msg.consumer in self.gone:
                raise SyncError(f"producer {self.cfg.rank}: consumer {msg.consumer!r} left; re-admission needs a new init")
            self._wait(lambda: key in self.ready or msg.version in self.failed,
                       f"group {msg.group!r} of version {msg.version} to be packed")
            if msg.version in self.failed:
                raise SyncError(f"producer {self.cfg.rank}: version {msg.version} failed: {self.failed[msg.version]}")
            return m.Ready(version=msg.version, group=msg.group, chunks=self.ready[key].get(plan_digest, []))
        if isinstance(msg, m.Released):
            with self.cv:
                self.pending.get((msg.version, msg.group), set()).discard(msg.consumer)
                self.cv.notify_all()
            return m.Ack()
        if isinstance(msg, m.Goodbye):
            with self.cv:
                self.gone.add(msg.consumer)
                for s in self.pending.values():
                    s.discard(msg.consumer)
                self.cv.notify_all()
            return m.Ack()
        raise SyncError(f"producer {self.cfg.rank}: unexpected message {type(msg).__name__}")

    def _wait(self, pred, what: str, timeout_s: float | None = None) -> None:
        timeout_s = self.cfg.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"producer {self.cfg.rank}: timed out after {timeout_s} s waiting for {what}")
                self.cv.wait(min(left, 1.0))

    # ------------------------------------------------------------------ init
    def init(self) -> None:
        cfg = self.cfg
        coord = self.address if cfg.rank == 0 else cfg.coordinator
        if coord is None:
            raise ValueError(f"producer {cfg.rank} needs the coordinator's address")
        held = self.source.held_names()
        self.client = m.ControlClient(coord, cfg.token, peer="coordinator (producer 0)")
        self.client.call(m.Join(rank=cfg.rank, address=self.address, held=None if held is None else sorted(held),
                                meta_digest=metadata_digest(self.metas)), timeout_s=cfg.init_timeout_s)
        asg = self.client.call(m.GetAssignments(rank=cfg.rank), timeout_s=cfg.init_timeout_s + 5)
        if not isinstance(asg, m.Assignments):
            raise TransportError(f"producer {cfg.rank}: coordinator answered {type(asg).__name__}, expected Assignments")
        self.plans = {p.digest: p for p in (Plan.from_json(b) for b in asg.plans)}
        self.consumer_plan = {c: d for d, cs in asg.consumers.items() for c in cs}
        self.consumers_of = {d: set(cs) for d, cs in asg.consumers.items()}
        holders = holders_from_ownership(asg.held, [x.name for x in self.metas])
        self.layouts = {d: chunk_layouts(p, holders, max_chunk_bytes=cfg.max_chunk_bytes) for d, p in self.plans.items()}
        self.units: dict[str, list[_Unit]] = defaultdict(list)
        slot_end: dict[str, int] = defaultdict(int)  # units of every plan share their group's slot
        for d, routes in sorted(asg.routes.items()):
            for g, per_chunk in routes.items():
                for ci, p in enumerate(per_chunk):
                    if p == cfg.rank:
                        lay, gp = self.layouts[d][g], self.plans[d].group(g)
                        c = lay.chunks[ci]
                        srcs = frozenset(s.src for s in gp.scatters[c.first:c.stop])
                        self.units[g].append(_Unit(d, c, slot_end[g], GroupPacker(gp, lay), srcs))
                        slot_end[g] = _align(slot_end[g] + c.nbytes, 64)
        self.order = group_order(self.units)
        self.sources = {g: sorted(frozenset().union(*(u.sources for u in us))) for g, us in self.units.items()}
        slot = max((u.slot_offset + u.chunk.nbytes for us in self.units.values() for u in us), default=0)
        self.slot_bytes = _align(max(slot, 1), 64)
        self.n_slots = cfg.lookahead + 1
        self.ring = torch.zeros(self.n_slots * self.slot_bytes, dtype=torch.uint8)
        desc = self.transport.register(self.ring)
        self.client.call(m.ProducerReady(rank=cfg.rank, desc=desc), timeout_s=cfg.init_timeout_s)
        self.stats = {"rank": cfg.rank, "groups": len(self.order), "slot_bytes": self.slot_bytes,
                      "ring_bytes": self.ring.numel()}

    # ------------------------------------------------------------------ sync
    def sync(self, version: int) -> dict[str, Any]:
        """Serve one weight version; returns per-sync stats (bytes sent, max resident groups, seconds).
        A failure here is made known to every consumer waiting on this version before it is re-raised."""
        try:
            return self._sync(version)
        except BaseException as e:
            with self.cv:
                self.failed[version] = f"{type(e).__name__}: {e}"
                self.cv.notify_all()
            raise

    def _sync(self, version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        by_name = {x.name: x for x in self.metas}
        free = list(range(self.n_slots))
        slot_of: dict[str, int] = {}
        resident = max_resident = 0
        sent = 0
        live = lambda d: self.consumers_of[d] - self.gone  # noqa: E731
        for g in self.order:
            # rule 2: wait for a free slot (a released group frees its slot)
            def reclaim() -> bool:
                for gg, s in list(slot_of.items()):
                    if not self.pending.get((version, gg)):
                        free.append(s)
                        del slot_of[gg]
                return bool(free)
            self._wait(reclaim, f"a free ring slot for group {g!r} (held by {sorted(slot_of)}: consumers "
                                f"{sorted({c for gg in slot_of for c in self.pending.get((version, gg), ())})} "
                                "have not released them)")
            resident = len(slot_of) + 1
            max_resident = max(max_resident, resident)
            slot = free.pop(0)
            units = self.units[g]
            full = self.source.gather(self.sources[g])
            for n, t in full.items():
                check_tensor(by_name[n], t, rank=self.cfg.rank)
            full = {n: t.contiguous() for n, t in full.items()}
            ready: dict[str, list[list[int]]] = defaultdict(list)
            base = slot * self.slot_bytes
            for u in units:
                c = u.chunk
                region = self.ring[base + u.slot_offset: base + u.slot_offset + c.nbytes]
                u.packer.pack(full, region, c, base=c.start)
                ready[u.digest].append([c.index, base + u.slot_offset, c.nbytes])
                sent += c.nbytes * len(live(u.digest))
            del full  # rule 2: gathered tensors are not kept past packing
            with self.cv:
                self.pending[(version, g)] = set().union(*(live(u.digest) for u in units))
                self.ready[(version, g)] = dict(ready)
                slot_of[g] = slot
                self.cv.notify_all()
        self._wait(lambda: all(not self.pending.get((version, g)) for g in self.order),
                   f"every consumer to release version {version} "
                   f"(missing: {sorted({c for g in self.order for c in self.pending.get((version, g), ())})})")
        with self.cv:
            for g in self.order:
                self.ready.pop((version, g), None)
                self.pending.pop((version, g), None)
        self.stats.update(version=version, seconds=time.perf_counter() - t0, bytes_sent=sent,
                          max_resident=max_resident, lookahead=self.cfg.lookahead)
        return dict(self.stats)

    def close(self) -> None:
        self.server.close()
        self.transport.close()
