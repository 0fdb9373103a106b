"""Trainer side: gather one weight group at a time, replay + pack, serve pulls, free on release.

What is gathered when, how many groups are resident and when a ring slot is freed are ``engine/schedule.py``'s
rules 1-7; one sync's loop is ``producer_sync.py``. This module holds the configuration, the producer's control
handler (``WaitReady``, ``Released``, ``Abandon``; rank 0 also hosts the coordinator), init and the sync's
start and failure:

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

import threading
import time
from collections import defaultdict
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import torch

from ..protocol import messages as m
from ..protocol.control import ControlClient, ControlServer
from ..coordinator.coordinator import Coordinator
from ..protocol.heartbeat import Heartbeat
from ..lanes import Lane, hot_path
from .producer_sync import ProducerSync, finish_lockstep
from .snapshot import PendingSync, Snapshot
from ...security.chunkmac import chunk_key
from ...delta.sender import DeltaSender
from .same_batches import SameBatches
from ..source_reads.source_share import SourceShare
from .units import build_units
from .versions import ServedVersions, VersionState
from ..protocol.wire import DEFAULT_MAX_FRAME, parse_address
from ...errors import ConsumerDropped, SyncError
from ...plan.pack import DEFAULT_CHUNK_BYTES
from ...source import WeightSource
from ...sources.adapt import adapt
from ...transport import Transport, make_transport
from ...types import dtype_of, metadata_digest

EARLY_ABANDON_AHEAD = 4
"""An Abandon may come at most this many versions before this rank begins it (a consumer leaves the version it is
in, or the next one)."""
EARLY_ABANDON_MAX = 4096
"""Abandons held for versions not begun yet, in all."""


@dataclass
class ProducerConfig:
    rank: int
    n_producers: int
    n_consumers: int
    token: str = field(repr=False)
    """The group's shared secret (never in ``repr``, logs or errors)."""
    host: str = "127.0.0.1"
    """Interface the control server (and the tcp transport) bind to."""
    advertise_host: str | None = None
    """Address peers are told to use (required in practice when ``host`` is 0.0.0.0)."""
    port: int = 0
    """Control port; rank 0's is the coordinator address consumers are given."""
    coordinator: list[Any] | str | None = None
    """Address of rank 0's control server (ranks > 0): ``"host:port"`` or ``[host, port]``."""
    transport: str = "tcp"
    transport_kwargs: dict[str, Any] = field(default_factory=dict)
    lookahead: int = 1
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout_s: float = 120.0
    """Bound on every wait during a sync for a peer that is alive but slow."""
    init_timeout_s: float = 600.0
    """Bound on init waits (peers start engines, record and validate plans: slower than a sync)."""
    lease_s: float = 10.0
    """A peer that sends no heartbeat for this long is dead: the bound on detecting a dead consumer/producer."""
    straggler_s: float | None = None
    """A member that has not released a group this long after it was announced, nor any other group of this rank in
    that time, is dropped from that version (rule 2 above; it receives the next one). None: three leases, at least
    10 s, at most half of ``timeout_s``. It bounds how long after the trainer's ``sync`` an engine starts pulling and
    one group's pull (and, for direct reads, apply): raise it for engines that are slow to start an update."""
    min_consumers: int | None = None
    """Init quorum (default: all ``n_consumers``); with fewer, init proceeds after ``join_grace_s``."""
    join_grace_s: float = 30.0
    max_routed_bytes: int | None = None
    """Rank 0: what all consumers' routed plans together may carry a sync (None: 64 copies of the model). A plan
    past it is refused at its registration, naming the consumer: no buggy or hostile engine grows the rings (trainer
    memory, GPU memory with ``device``) without bound. Plans of consumers that left are pruned at the next version."""
    verify_checksums: bool | None = None
    """Send an xxh3-64 checksum of every chunk; consumers verify it (silent corruption -> ChecksumError). None: on
    where the ring is in host memory (xxh3 runs at ~9 GB/s a core here, faster than the tcp link), off for a GPU ring
    (``device``: each chunk would be copied to the host for it). See :attr:`Producer.checksums`."""
    mac: bool = False
    """For networks an attacker can write to: every chunk carries a keyed tag (``chunkmac.py``: BLAKE2b keyed from the
    token, bound to this rank, the version, group, chunk and length; consumers check it -> ChunkMacError), replacing
    the xxh3 checksums, and every control frame a MAC (``security/framemac.py``: a key fresh per connection, a
    sequence number per direction). Every rank of a group must agree (checked at ``Join``). Costs a keyed hash of
    every byte on both sides (``benchmarks/checksum_cost.py``)."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    device: str | None = None
    """Where the ring lives and packing runs (``"cuda:0"``; None: CPU memory). With a GPU the ring is allocated
    there once (``stats["ring_bytes"]``: subtract it from what the trainer may use), replay + pack run on a side
    stream after the stream that wrote the weights, and a group is announced once its pack has run; the transport
    must move GPU memory (``cuda_ipc``, ``nccl``, ``nixl``)."""
    switch_interval_s: float | None = 0.0002
    """While a sync runs, the process's GIL switch interval (and the cyclic GC is paused); restored afterwards.
    None leaves the interpreter alone (see ``engine/lanes.hot_path``)."""
    node: str = ""
    """Where this rank runs (a Ray node id, a hostname; "" = unknown): consumers that say they run on the same node
    read from it first (``plan/route.py`` rule 5)."""
    gather_budget_bytes: int | None = None
    """Most full-tensor bytes this rank may hold at once while gathering (None: unbounded). Refused at init when
    the source's largest gather group (plus what must be carried across groups) does not fit."""
    delta: bool = False
    """Delta sync (``delta/sender.py``, ``docs/delta.md``): each chunk is also offered as the words that changed
    since this rank last served it, beside its dense bytes; consumers with ``delta=True`` holding that version read
    only the changes. Costs, on the ring's device: a delta area per ring slot (the ring doubles: ``ring_bytes``) and
    the history of served chunks (``delta_history_bytes``), plus an encode pass per chunk and its xxh3 checksum."""
    source_reads: bool | None = None
    """Serve groups where the trainer's tensors lie to consumers that map this rank's memory (``source_share.py``: no
    pack pass, no ring slot). None: on for a GPU ring; needs no checksums, ``mac`` or delta."""
    delta_budget_bytes: int | None = None
    """Most bytes the delta history may keep (the served chunks once, the rest for its undo journal); None: twice
    the chunks. Refused at init (``DeltaBudgetError``) when the chunks alone do not fit."""


class Producer(ServedVersions):
    def __init__(self, source: WeightSource | Any, cfg: ProducerConfig, transport: Transport | None = None):
        self.source, self.cfg = adapt(source), cfg
        self.metas = self.source.metadata()
        self._own_transport = transport is None
        self.transport = transport or self._make_transport()
        self.coordinator = Coordinator(
            metadata=self.metas, n_producers=cfg.n_producers, n_consumers=cfg.n_consumers,
            max_chunk_bytes=cfg.max_chunk_bytes, timeout_s=cfg.timeout_s, init_timeout_s=cfg.init_timeout_s,
            lease_s=cfg.lease_s, min_consumers=cfg.min_consumers, join_grace_s=cfg.join_grace_s,
            max_routed_bytes=cfg.max_routed_bytes, mac=cfg.mac) \
            if cfg.rank == 0 else None
        self.server = ControlServer(cfg.host, cfg.port, cfg.token, self._handle, advertise_host=cfg.advertise_host,
                                    max_frame_bytes=cfg.max_frame_bytes, name=f"producer{cfg.rank}", mac=cfg.mac)
        if self.coordinator is not None:  # its init waits name the connections refused for a wrong token
            self.coordinator.refusals = self.server.refusals
        self.address = self.server.address
        self.cv = threading.Condition()
        self.versions: dict[int, VersionState] = {}
        self.abandoned: dict[int, dict[str, tuple[str, str]]] = defaultdict(dict)
        """version -> consumer -> (session, reason): Abandons that came before this rank began the version; applied
        at its begin only where the session is the member's (checked then: this rank has no table before)."""
        self.epoch = -1
        self.reads_sources: dict[str, bool] = {}
        self.same_batches = SameBatches()
        """Per gather batch: the last sync's checks, reused while the source yields the same objects."""
        self.ring: torch.Tensor | None = None
        self.heartbeat: Heartbeat | None = None
        self._pending: PendingSync | None = None
        self.stats: dict[str, Any] = {}
        self.lane = Lane(cfg.device)
        wanted = cfg.verify_checksums if cfg.verify_checksums is not None else not (self.lane.cuda or cfg.source_reads)
        self.checksums = wanted and not cfg.mac
        self.shares = SourceShare.configured(cfg, self.transport, gpu=self.lane.cuda, checksums=self.checksums)
        """Source reads (``ProducerConfig.source_reads``), when on."""
        """Whether this rank sends an xxh3 checksum with every chunk (``ProducerConfig.verify_checksums``; None: host
        rings; never with ``mac``, whose tags supersede them)."""
        self.chunk_key = chunk_key(cfg.token) if cfg.mac else None
        """With ``mac``: the key this rank tags its chunks with (derived from the token; never sent or printed)."""
        self._expect = {x.name: (torch.Size(x.shape), dtype_of(x.dtype)) for x in self.metas}
        if self.lane.cuda and not self.transport.caps.gpu:
            raise SyncError(f"producer {cfg.rank}: transport {self.transport.name!r} cannot move GPU memory (ring on "
                            f"{cfg.device}); use cuda_ipc, nccl or nixl")

    def _make_transport(self) -> Transport:
        """The data plane; the tcp and nccl transports bind where the control plane does, advertise the same address
        and check the group's token (unless ``transport_kwargs`` say otherwise)."""
        kw = dict(self.cfg.transport_kwargs)
        if self.cfg.transport in ("tcp", "nccl", "auto"):
            kw.setdefault("token", self.cfg.token)
            kw.setdefault("host", self.cfg.host)
            kw.setdefault("advertise_host", self.cfg.advertise_host)
        return make_transport(self.cfg.transport, **kw)

    # ------------------------------------------------------------------ control handler
    def _handle(self, msg: m.Msg) -> m.Msg:
        if self.coordinator is not None:
            reply = self.coordinator.handle(msg)
            if reply is not None:
                return reply
        if isinstance(msg, m.WaitReady):
            return self._on_wait_ready(msg)
        if isinstance(msg, (m.Released, m.Abandon)):
            with self.cv:
                st = self.versions.get(msg.version)
                if st is None:
                    if isinstance(msg, m.Released):
                        raise SyncError(f"producer {self.cfg.rank}: release for version {msg.version}, not begun")
                    self._early_abandon(msg)
                    return m.Ack()
                self._member(st, msg.consumer, msg.session, msg.version)
                if isinstance(msg, m.Released):
                    if msg.consumer in st.dropped:  # its slot may hold another group by now: what it read is suspect
                        raise ConsumerDropped(f"producer {self.cfg.rank}: release of group {msg.group!r} refused: "
                                              f"consumer {msg.consumer!r} was dropped from version {msg.version}: "
                                              f"{st.dropped[msg.consumer]}")
                    st.pending.get(msg.group, set()).discard(msg.consumer)
                    st.released_at[msg.consumer] = time.monotonic()
                else:
                    if msg.lost_producer >= 0 and not st.done:  # a producer died: this version fails for all
                        st.failed = st.failed or (f"consumer {msg.consumer} lost producer {msg.lost_producer}: "
                                                  f"{msg.reason}")
                    self._drop(st, msg.consumer, f"abandoned version {msg.version}: {msg.reason}")
                self.cv.notify_all()
            return m.Ack()
        raise SyncError(f"producer {self.cfg.rank}: unexpected message {type(msg).__name__}")

    def _early_abandon(self, msg: m.Abandon) -> None:
        """An Abandon for a version this rank has not begun: kept (bounded) until it begins."""
        lo = max(self.versions) + 1 if self.versions else 0  # the first version this rank has not begun
        if not lo <= msg.version <= lo + EARLY_ABANDON_AHEAD:
            raise SyncError(f"producer {self.cfg.rank}: abandon of version {msg.version} by {msg.consumer!r}: only "
                            f"versions {lo}..{lo + EARLY_ABANDON_AHEAD} can be abandoned before they begin")
        if sum(map(len, self.abandoned.values())) >= EARLY_ABANDON_MAX and msg.consumer not in \
                self.abandoned.get(msg.version, {}):
            raise SyncError(f"producer {self.cfg.rank}: {EARLY_ABANDON_MAX} early abandons held already")
        self.abandoned[msg.version][msg.consumer] = (msg.session, m.clip(msg.reason))

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
        self.incarnation = self.client.call(self._join, timeout_s=cfg.init_timeout_s).incarnation
        if cfg.rank != 0:
            self.heartbeat = Heartbeat(coord, cfg.token, m.Renew(rank=cfg.rank, incarnation=self.incarnation),
                                       lease_s=cfg.lease_s, who=f"producer {cfg.rank}", on_change=self._wake,
                                       on_dropped=self._rejoin, require_mac=cfg.mac)
        self._assign(self.client.call(m.GetAssignments(rank=cfg.rank), timeout_s=cfg.init_timeout_s + 5))
        self.client.call(m.ProducerReady(rank=cfg.rank, incarnation=self.incarnation, version=-1, desc=self.desc),
                         timeout_s=cfg.init_timeout_s)

    def _rejoin(self, why: str) -> None:
        """Our lease lapsed (a pause, a starved process): the sync in flight has failed for everyone; join again
        as a new incarnation with the same ring, so the next sync includes this rank."""
        assert self.heartbeat is not None
        self.incarnation = self.client.call(self._join, timeout_s=self.cfg.timeout_s).incarnation
        self.heartbeat.set_renew(m.Renew(rank=self.cfg.rank, incarnation=self.incarnation))
        self.client.call(m.ProducerReady(rank=self.cfg.rank, incarnation=self.incarnation, version=-1, desc=self.desc),
                         timeout_s=self.cfg.timeout_s)

    def _wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def _assign(self, asg: Any) -> None:
        """Build this rank's units from the coordinator's assignments (at init, and when a rejoiner's new plan
        bumped the epoch); the ring is (re)allocated only if a slot must grow."""
        cfg = self.cfg
        self.units, self.schedule, slot = build_units(asg, self.metas, self.source, rank=cfg.rank,
                                                      max_chunk_bytes=cfg.max_chunk_bytes)
        if cfg.gather_budget_bytes is not None and self.schedule.peak_bytes > cfg.gather_budget_bytes:
            b = max(range(len(self.schedule.batches)), key=lambda i: self.schedule.batch_bytes[i])
            raise SyncError(f"producer {cfg.rank}: gathering needs up to {self.schedule.peak_bytes} bytes of full "
                            f"tensors at once (the largest gather group, starting {self.schedule.batches[b][0]!r}, is "
                            f"{self.schedule.batch_bytes[b]} bytes), above gather_budget_bytes="
                            f"{cfg.gather_budget_bytes}")
        self.order = self.schedule.order
        self.same_batches.reset()  # a new schedule: its batches are checked in full again
        self.unit_sources = {g: sorted(frozenset().union(*(u.sources for u in us))) for g, us in self.units.items()}
        self.by_source: set[str] = set()  # groups served by their source tensors last sync (no ring slot awaited)
        self.n_slots = cfg.lookahead + 1
        self.delta = None
        if cfg.delta:  # a delta area as large as the dense part beside it in every slot
            self.delta = DeltaSender(self.units, device=self.lane.device, budget_bytes=cfg.delta_budget_bytes)
            self.dense_slot, slot = slot, 2 * slot
        else:
            self.dense_slot = slot
        if self.ring is None or slot > self.slot_bytes:
            if self.ring is not None:  # a rejoiner's plan needs bigger slots: a new ring, a new descriptor
                if not self._own_transport:
                    raise SyncError(f"producer {cfg.rank}: a new plan needs {slot}-byte ring slots (have "
                                    f"{self.slot_bytes}) and the transport was passed in: it cannot be re-registered")
                self.transport.close()
                self.transport = self._make_transport()
            self.slot_bytes = slot
            self.ring = torch.zeros(self.n_slots * slot, dtype=torch.uint8, device=self.lane.device)
            self.desc = self.transport.register(self.ring)
        self.epoch = asg.epoch
        self.stats = {"rank": cfg.rank, "groups": len(self.order), "slot_bytes": self.slot_bytes,
                      "ring_bytes": self.ring.numel(), "gather_batches": len(self.schedule.batches),
                      "planned_peak_gathered_bytes": self.schedule.peak_bytes,
                      **(self.delta.stats() if self.delta is not None else {})}

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
            if block:
                with hot_path(self.cfg.switch_interval_s):
                    return ProducerSync(self, version, st, self.source).run()
            snap = Snapshot(self, version)
            pending = PendingSync(version)

            def serve() -> None:
                try:
                    with hot_path(self.cfg.switch_interval_s):
                        pending._set(ProducerSync(self, version, st, snap, snapshot_bytes=snap.nbytes).run())
                except BaseException as e:
                    self._fail(version, st, e)
                    pending._set(error=e)

            pending._thread = threading.Thread(target=serve, name=f"shardsync-serve-v{version}", daemon=True)
            self._pending = pending
            pending._thread.start()
            return pending
        except BaseException as e:
            if not getattr(e, "_shardsync_reported", False):
                self._fail(version, st, e)
            raise

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
        with self.cv:
            st = self.versions[version] = VersionState(
                {c: (d, s) for c, (d, s) in view.members.items() if d in digests},
                incarnations={int(p["rank"]): int(p["incarnation"]) for p in view.producers})
            for c, (session, why) in self.abandoned.pop(version, {}).items():
                if st.members.get(c, ("", ""))[1] == session:  # a forged one (wrong session) is ignored
                    self._drop(st, c, f"abandoned version {version}: {why}")
            for old in [v for v in self.versions if v < version - 4]:
                del self.versions[old]
            for old in [v for v in self.abandoned if v <= version]:  # bounded: only versions yet to begin
                del self.abandoned[old]
        self.client.call(m.ProducerReady(rank=self.cfg.rank, incarnation=self.incarnation, version=version,
                                         desc=self.desc), timeout_s=quick)
        return st

    def _fail(self, version: int, st: VersionState | None, e: BaseException) -> None:
        why = f"{type(e).__name__}: {e}"
        with self.cv:
            if st is not None:  # nothing stays referenced for a failed version
                st.failed = why
                st.pending.clear()
                st.ready.clear()
            self.cv.notify_all()
        if getattr(e, "_shardsync_reported", False):
            return
        with suppress(Exception):  # within a lease: the coordinator may be what failed (stopped: it would not answer)
            self.client.call(m.SyncFailed(rank=self.cfg.rank, version=version, reason=why),
                             timeout_s=min(5.0, self.cfg.lease_s + 1))
        with suppress(Exception):
            e._shardsync_reported = True  # type: ignore[attr-defined]

    def _drain(self, timeout_s: float = 5.0) -> None:
        """Let the replies to releases already handled go out before returning (a ``close()`` or the trainer
        exiting right after ``sync`` must not cut a consumer's last ``Released`` short)."""
        deadline = time.monotonic() + timeout_s
        while self.server.inflight("Released", "Abandon", "Completed") and time.monotonic() < deadline:
            time.sleep(0.002)

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
