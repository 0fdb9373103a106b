"""The producer's per-version serving state: who is a member of each version, which groups are packed and
unreleased (a slot is freed by ``engine/schedule.py``'s rule 7), who was dropped and why (rules 1-3 of
``engine/producer/producer.py``: dead, abandoning and straggling members), and the ``WaitReady`` answers.

:class:`VersionTable` owns that state (version -> :class:`VersionState`, the Abandons that came early, which consumers
map this rank's memory) and the condition every change of it notifies. A :class:`~.producer.Producer` owns one; it
is given what it reads and nothing more: the config (``rank``, ``lease_s``, ``timeout_s``, ``straggler_s``), the lease
view to prune by (the coordinator's on rank 0, the heartbeat's elsewhere) and where stragglers are reported::

    table = VersionTable(cfg, lease_view=coordinator.lease_view, on_stragglers=report)
    st = table.begin(version, members, incarnations)      # members: consumer -> (plan digest, session)
    table.announce(st, group, ready)                       # a packed group may be pulled
    table.wait(lambda: not st.pending.get(group), lambda: "its release", version, st)
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from ..protocol import messages as m
from ...errors import AuthError, ConsumerDropped, ProducerLost, SyncError, TransportError

__all__ = ["VersionState", "VersionTable", "next_group_for", "EARLY_ABANDON_AHEAD", "EARLY_ABANDON_MAX"]

EARLY_ABANDON_AHEAD = 4
"""An Abandon may come at most this many versions before this rank begins it (a consumer leaves the version it is
in, or the next one)."""
EARLY_ABANDON_MAX = 4096
"""Abandons held for versions not begun yet, in all."""
KEEP_BEHIND = 4
"""Versions older than the one begun by more than this are forgotten."""


@dataclass
class VersionState:
    """What one producer knows about one version it serves."""

    members: dict[str, tuple[str, str]]  # consumer -> (digest, session)
    ready: dict[str, dict[str, m.Ready]] = field(default_factory=dict)  # group -> digest -> its announcement
    packed: list[str] = field(default_factory=list)  # groups in the order they were packed
    pending: dict[str, set[str]] = field(default_factory=dict)  # group -> consumers yet to release
    dropped: dict[str, str] = field(default_factory=dict)  # consumer -> why
    dropped_at: dict[str, float] = field(default_factory=dict)  # consumer -> when (time.time())
    announced: dict[str, float] = field(default_factory=dict)  # group -> when it was announced (time.monotonic())
    released_at: dict[str, float] = field(default_factory=dict)  # consumer -> its last Released here (monotonic)
    failed: str = ""
    done: bool = False
    incarnations: dict[int, int] = field(default_factory=dict)  # rank -> incarnation serving this version


READIES_BYTES = 4 << 20
"""The most (estimated) bytes of one ``Readies`` answer: further groups wait for the next ask."""


def _ready_bytes(r: m.Ready) -> int:
    """An upper estimate of ``r``'s encoded size (its lists' ints at 9 bytes each, its tags and table as they are)."""
    return 64 + len(r.group) + len(r.sources) + 18 * len(r.tags) + 9 * sum(map(len, r.chunks)) + \
        9 * sum(map(len, r.deltas))


def next_group_for(st: VersionState, cid: str, digest: str, after: str = "") -> str:
    """The first group packed for this consumer's plan, after group ``after`` if given, that it has not
    released yet ("" if none is packed yet). Idempotent: asked again before ``Released`` (a reply lost to a
    broken connection), it names the same group."""
    start = 0
    if after:
        if after not in st.packed:
            raise SyncError(f"consumer {cid!r} asked for the group after {after!r}, which this producer has "
                            "not packed in this version")
        start = st.packed.index(after) + 1
    for g in st.packed[start:]:
        if digest in st.ready.get(g, {}) and cid in st.pending.get(g, ()):
            return g
    return ""


class VersionTable:
    """Every version this rank serves (or served recently), under one condition ``cv``."""

    def __init__(self, cfg: Any, *, lease_view: Callable[[], dict[str, Any]],
                 on_stragglers: Callable[[int, list[tuple[str, str, str]]], None]):
        self.cfg = cfg
        """Reads ``rank``, ``lease_s``, ``timeout_s`` and ``straggler_s`` (a ``ProducerConfig``)."""
        self.lease_view = lease_view
        """What the coordinator knows of leases: ``dead``, ``left``, ``dead_producers``, ``failed``."""
        self.on_stragglers = on_stragglers
        """Called (with ``cv`` held) with a version and the ``(consumer, session, why)`` of members just dropped
        from it as stragglers: the coordinator is to be told."""
        self.cv = threading.Condition()
        """Notified by every change of the table (and by the heartbeat's lease changes)."""
        self.versions: dict[int, VersionState] = {}
        self.abandoned: dict[int, dict[str, tuple[str, str]]] = defaultdict(dict)
        """version -> consumer -> (session, reason): Abandons that came before this rank began the version; applied
        at its begin only where the session is the member's (checked then: this rank has no table before)."""
        self.reads_sources: dict[str, bool] = {}
        """Consumer -> whether its last ``WaitReady`` said it maps this producer's memory (source reads)."""
        self.takes_deltas: dict[str, bool] = {}
        """Consumer -> whether its last ``WaitReady`` said it reads this producer's deltas (unknown: it may)."""

    # ------------------------------------------------------------------ a version's life
    def begin(self, version: int, members: dict[str, tuple[str, str]], incarnations: dict[int, int]) -> VersionState:
        """The version's state, its members fixed (early Abandons applied); old versions are forgotten."""
        with self.cv:
            st = self.versions[version] = VersionState(members, incarnations=incarnations)
            for c, (session, why) in self.abandoned.pop(version, {}).items():
                if st.members.get(c, ("", ""))[1] == session:  # a forged one (wrong session) is ignored
                    self.drop(st, c, f"abandoned version {version}: {why}")
            for old in [v for v in self.versions if v < version - KEEP_BEHIND]:
                del self.versions[old]
            for old in [v for v in self.abandoned if v <= version]:  # bounded: only versions yet to begin
                del self.abandoned[old]
        return st

    def announce(self, st: VersionState, g: str, ready: dict[str, m.Ready]) -> None:
        """Group ``g`` may be pulled (its ``Ready`` per plan digest); its members' straggler clocks start now."""
        with self.cv:
            st.ready[g] = ready
            st.packed.append(g)
            st.announced[g] = time.monotonic()
            self.cv.notify_all()

    def finish(self, st: VersionState) -> None:
        """This rank's part of the version is served: nothing stays announced."""
        with self.cv:
            st.done = True
            st.ready.clear()

    def fail(self, st: VersionState | None, why: str) -> None:
        """The version failed (``st`` None: before its state existed); every waiter wakes."""
        with self.cv:
            if st is not None:  # nothing stays referenced for a failed version
                st.failed = why
                st.pending.clear()
                st.ready.clear()
            self.cv.notify_all()

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    # ------------------------------------------------------------------ consumers' messages
    def member(self, st: VersionState, cid: str, session: str, version: int) -> str:
        """The consumer's plan digest, if ``session`` is its credential in this version."""
        ds = st.members.get(cid)
        if ds is None:
            raise ConsumerDropped(f"producer {self.cfg.rank}: consumer {cid!r} is not a member of version {version}")
        if ds[1] != session:
            raise AuthError(f"producer {self.cfg.rank}: session credential does not belong to consumer {cid!r}")
        return ds[0]

    def wait_ready(self, msg: m.WaitReady) -> m.Msg:
        """The next group announced for the consumer (``Ready``), or ``Pending`` after a short poll."""
        poll = min(1.0, self.cfg.lease_s / 4)
        deadline = time.monotonic() + poll
        with self.cv:
            while True:
                st = self.versions.get(msg.version)
                if st is not None:
                    digest = self.member(st, msg.consumer, msg.session, msg.version)
                    if self.reads_sources.get(msg.consumer) is not msg.sources:
                        if len(self.reads_sources) > 4096:  # bounded (only members get here)
                            self.reads_sources.clear()
                        self.reads_sources[msg.consumer] = msg.sources
                    if self.takes_deltas.get(msg.consumer) is not msg.deltas:
                        if len(self.takes_deltas) > 4096:
                            self.takes_deltas.clear()
                        self.takes_deltas[msg.consumer] = msg.deltas
                    if st.failed:
                        raise SyncError(f"producer {self.cfg.rank}: version {msg.version} failed: {st.failed}")
                    if msg.consumer in st.dropped:
                        raise ConsumerDropped(f"producer {self.cfg.rank}: consumer {msg.consumer!r} was dropped from "
                                              f"version {msg.version}: {st.dropped[msg.consumer]}")
                    g = msg.group or next_group_for(st, msg.consumer, digest, msg.after)
                    if g and g in st.ready:
                        first = st.ready[g].get(digest) or m.Ready(version=msg.version, group=g, chunks=[])
                        return first if msg.group or not msg.more else self._more(st, msg, digest, first)
                left = deadline - time.monotonic()
                if left <= 0:
                    return m.Pending()
                self.cv.wait(left)

    @staticmethod
    def _more(st: VersionState, msg: m.WaitReady, digest: str, first: m.Ready) -> m.Msg:
        """``first`` and up to ``msg.more`` further groups announced for this consumer, each the next after the one
        before (called with ``cv`` held): what the consumer would get asking one at a time with ``after``, in one
        answer of at most ``READIES_BYTES`` (estimated)."""
        out, size = [first], _ready_bytes(first)
        while len(out) <= min(msg.more, m.MAX_MORE):
            g = next_group_for(st, msg.consumer, digest, out[-1].group)
            r = st.ready.get(g, {}).get(digest) if g else None
            nbytes = _ready_bytes(r) if r is not None else 0
            if r is None or size + nbytes > READIES_BYTES:
                break
            out.append(r)
            size += nbytes
        return first if len(out) == 1 else m.Readies(readies=out)

    def any_takes_deltas(self, consumers: set[str]) -> bool:
        """Whether some of ``consumers`` may read this producer's deltas (one not heard from yet may)."""
        with self.cv:
            return any(self.takes_deltas.get(c, True) for c in consumers)

    def release(self, msg: m.Released) -> None:
        """A member read group ``msg.group``: its slot may be reclaimed once every member did."""
        with self.cv:
            st = self.versions.get(msg.version)
            if st is None:
                raise SyncError(f"producer {self.cfg.rank}: release for version {msg.version}, not begun")
            self.member(st, msg.consumer, msg.session, msg.version)
            if msg.consumer in st.dropped:  # its slot may hold another group by now: what it read is suspect
                raise ConsumerDropped(f"producer {self.cfg.rank}: release of group {msg.group!r} refused: "
                                      f"consumer {msg.consumer!r} was dropped from version {msg.version}: "
                                      f"{st.dropped[msg.consumer]}")
            st.pending.get(msg.group, set()).discard(msg.consumer)
            st.released_at[msg.consumer] = time.monotonic()
            self.cv.notify_all()

    def abandon(self, msg: m.Abandon) -> None:
        """A member leaves the version (before it began here: held, bounded, until it begins)."""
        with self.cv:
            st = self.versions.get(msg.version)
            if st is None:
                self._hold_early(msg)
                return
            self.member(st, msg.consumer, msg.session, msg.version)
            if msg.lost_producer >= 0 and not st.done:  # a producer died: this version fails for all
                st.failed = st.failed or (f"consumer {msg.consumer} lost producer {msg.lost_producer}: "
                                          f"{msg.reason}")
            self.drop(st, msg.consumer, f"abandoned version {msg.version}: {msg.reason}")
            self.cv.notify_all()

    def _hold_early(self, msg: m.Abandon) -> None:
        """An Abandon for a version this rank has not begun: kept (bounded) until it begins."""
        lo = max(self.versions) + 1 if self.versions else 0  # the first version this rank has not begun
        if not lo <= msg.version <= lo + EARLY_ABANDON_AHEAD:
            raise SyncError(f"producer {self.cfg.rank}: abandon of version {msg.version} by {msg.consumer!r}: only "
                            f"versions {lo}..{lo + EARLY_ABANDON_AHEAD} can be abandoned before they begin")
        if sum(map(len, self.abandoned.values())) >= EARLY_ABANDON_MAX and msg.consumer not in \
                self.abandoned.get(msg.version, {}):
            raise SyncError(f"producer {self.cfg.rank}: {EARLY_ABANDON_MAX} early abandons held already")
        self.abandoned[msg.version][msg.consumer] = (msg.session, m.clip(msg.reason))

    # ------------------------------------------------------------------ dropping members, waiting
    def straggler_bound(self) -> float:
        """Seconds a member may hold an announced group before it is dropped from the version
        (``ProducerConfig.straggler_s``; default three leases, at least 10 s, at most half of ``timeout_s``)."""
        cfg = self.cfg
        if cfg.straggler_s is not None:
            return cfg.straggler_s
        return min(max(3 * cfg.lease_s, 10.0), cfg.timeout_s / 2)

    def drop(self, st: VersionState, cid: str, why: str) -> None:
        """Drop member ``cid`` from the version (called with ``cv`` held): no group waits for it any more."""
        if cid in st.members and cid not in st.dropped:
            st.dropped[cid], st.dropped_at[cid] = why, time.time()
            for s in st.pending.values():
                s.discard(cid)

    def _drop_stragglers(self, version: int, st: VersionState) -> None:
        """Rule 2 of ``producer.py``: a member that has not released a group ``straggler_bound()`` after it was
        announced, nor any other group here in that time, is dropped from this version (its slot is reclaimed) and
        the coordinator is told, so the other producers drop it too and the version's outcome counts it; it stays a
        member of the group."""
        bound, now, late = self.straggler_bound(), time.monotonic(), []
        for g, t in st.announced.items():
            if now - t <= bound or not st.pending.get(g):
                continue
            for cid in sorted(st.pending[g]):
                idle = now - max(t, st.released_at.get(cid, t))  # a member releasing other groups is progressing
                if idle <= bound:
                    continue
                why = (f"straggler: held group {g!r} of version {version} for {now - t:.1f} s after it was announced, "
                       f"{idle:.1f} s without a release here, past straggler_s={bound:g}")
                self.drop(st, cid, why)
                late.append((cid, st.members[cid][1], why))
        if late:
            self.on_stragglers(version, late)

    def prune(self, version: int, st: VersionState) -> None:
        """Apply what the coordinator knows: dead members are dropped; a dead producer or a failed version ends
        the sync (called with ``cv`` held, from every wait)."""
        if st.failed:
            raise ProducerLost(f"producer {self.cfg.rank}: version {version} failed: {st.failed}")
        view = self.lease_view()
        for cid, session, why in view["dead"]:
            if st.members.get(cid, ("", ""))[1] == session:
                self.drop(st, cid, why)
        for v, cid, session, why in view["left"]:
            if v == version and st.members.get(cid, ("", ""))[1] == session:
                self.drop(st, cid, f"abandoned version {version}: {why}")
        dead = {int(r): why for r, (inc, why) in view["dead_producers"].items()  # a stale entry for a rank that
                if inc >= st.incarnations.get(int(r), -1)}                         # rejoined since is not a death
        if dead:
            raise ProducerLost(f"producer {self.cfg.rank}, version {version}: " + "; ".join(dead.values()))
        why = view["failed"].get(version)
        if why:
            raise SyncError(f"producer {self.cfg.rank}: version {version} failed: {why}")
        if not st.done:
            self._drop_stragglers(version, st)

    def wait(self, pred: Callable[[], bool], what: Callable[[], str], version: int, st: VersionState) -> None:
        """Wait until ``pred()`` (checked with ``cv`` held), pruning the version each time; at most ``timeout_s``."""
        deadline = time.monotonic() + self.cfg.timeout_s
        with self.cv:
            while True:
                self.prune(version, st)
                if pred():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"producer {self.cfg.rank}: timed out after {self.cfg.timeout_s} s waiting "
                                         f"for {what()}")
                self.cv.wait(min(left, 0.25))

    def held_bytes(self) -> int:
        """Ring bytes still referenced by packed chunks some consumer has not released (0 between syncs)."""
        with self.cv:
            return sum(c[2] for st in self.versions.values() for g, per in st.ready.items() if st.pending.get(g)
                       for r in per.values() for c in r.chunks)
