"""The producer's per-version serving state: who is a member of each version, which groups are packed and
unreleased (a slot is freed by ``engine/schedule.py``'s rule 7), who was dropped and why (rules 1-3 of
``engine/producer/producer.py``: dead, abandoning and straggling members), and the ``WaitReady`` answers.

``ServedVersions`` is a mixin of :class:`~shardsync.engine.producer.producer.Producer`: it needs ``cfg`` (rank,
lease_s, timeout_s, straggler_s), ``client`` (to the coordinator), ``cv`` (the condition every state change
notifies), ``versions`` (version ->
:class:`VersionState`), and ``coordinator`` / ``heartbeat`` (the lease view it prunes by).
"""

from __future__ import annotations

import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from ..protocol import messages as m
from ...errors import AuthError, ConsumerDropped, ProducerLost, SyncError, TransportError

__all__ = ["VersionState", "ServedVersions"]


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


class ServedVersions:
    cfg: Any
    cv: Any
    versions: dict[int, VersionState]
    coordinator: Any
    heartbeat: Any
    client: Any
    """The control client to the coordinator (straggler reports)."""
    reads_sources: dict[str, bool]
    """Consumer -> whether its last ``WaitReady`` said it maps this producer's memory (source reads)."""

    def _member(self, st: VersionState, cid: str, session: str, version: int) -> str:
        """The consumer's plan digest, if ``session`` is its credential in this version."""
        ds = st.members.get(cid)
        if ds is None:
            raise ConsumerDropped(f"producer {self.cfg.rank}: consumer {cid!r} is not a member of version {version}")
        if ds[1] != session:
            raise AuthError(f"producer {self.cfg.rank}: session credential does not belong to consumer {cid!r}")
        return ds[0]

    def _on_wait_ready(self, msg: m.WaitReady) -> m.Msg:
        poll = min(1.0, self.cfg.lease_s / 4)
        deadline = time.monotonic() + poll
        with self.cv:
            while True:
                st = self.versions.get(msg.version)
                if st is not None:
                    digest = self._member(st, msg.consumer, msg.session, msg.version)
                    if self.reads_sources.get(msg.consumer) is not msg.sources:
                        if len(self.reads_sources) > 4096:  # bounded (only members get here)
                            self.reads_sources.clear()
                        self.reads_sources[msg.consumer] = msg.sources
                    if st.failed:
                        raise SyncError(f"producer {self.cfg.rank}: version {msg.version} failed: {st.failed}")
                    if msg.consumer in st.dropped:
                        raise ConsumerDropped(f"producer {self.cfg.rank}: consumer {msg.consumer!r} was dropped from "
                                              f"version {msg.version}: {st.dropped[msg.consumer]}")
                    g = msg.group or self._next_for(st, msg.consumer, digest, msg.after)
                    if g and g in st.ready:
                        return st.ready[g].get(digest) or m.Ready(version=msg.version, group=g, chunks=[])
                left = deadline - time.monotonic()
                if left <= 0:
                    return m.Pending()
                self.cv.wait(left)

    @staticmethod
    def _next_for(st: VersionState, cid: str, digest: str, after: str = "") -> str:
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

    def announce(self, st: VersionState, g: str, ready: dict[str, m.Ready]) -> None:
        """Group ``g`` may be pulled (its ``Ready`` per plan digest); its members' straggler clocks start now."""
        with self.cv:
            st.ready[g] = ready
            st.packed.append(g)
            st.announced[g] = time.monotonic()
            self.cv.notify_all()

    def straggler_bound(self) -> float:
        """Seconds a member may hold an announced group before it is dropped from the version
        (``ProducerConfig.straggler_s``; default three leases, at least 10 s, at most half of ``timeout_s``)."""
        cfg = self.cfg
        if cfg.straggler_s is not None:
            return cfg.straggler_s
        return min(max(3 * cfg.lease_s, 10.0), cfg.timeout_s / 2)

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
                self._drop(st, cid, why)
                late.append(m.Straggler(rank=self.cfg.rank, incarnation=getattr(self, "incarnation", 0),
                                        version=version, consumer=cid, session=st.members[cid][1], reason=why))
        if late:
            self.report_stragglers(late)

    def report_stragglers(self, msgs: list[m.Straggler]) -> None:
        """Tell the coordinator, in the background (called with ``cv`` held) and best effort: without it the other
        producers still drop the straggler by their own clocks, and the outcome waits for it at most ``timeout_s``."""
        client, bound = self.client, min(5.0, self.cfg.lease_s + 1)

        def tell() -> None:
            for msg in msgs:
                with suppress(Exception):
                    client.call(msg, timeout_s=bound)

        threading.Thread(target=tell, name=f"shardsync-straggler-p{self.cfg.rank}", daemon=True).start()

    def _drop(self, st: VersionState, cid: str, why: str) -> None:
        if cid in st.members and cid not in st.dropped:
            st.dropped[cid], st.dropped_at[cid] = why, time.time()
            for s in st.pending.values():
                s.discard(cid)

    def _prune(self, version: int, st: VersionState) -> None:
        """Apply what the coordinator knows: dead members are dropped; a dead producer or a failed version ends
        the sync (called with ``cv`` held, from every wait)."""
        if st.failed:
            raise ProducerLost(f"producer {self.cfg.rank}: version {version} failed: {st.failed}")
        view = self.coordinator.lease_view() if self.coordinator is not None else self.heartbeat.view()
        for cid, session, why in view["dead"]:
            if st.members.get(cid, ("", ""))[1] == session:
                self._drop(st, cid, why)
        for v, cid, session, why in view["left"]:
            if v == version and st.members.get(cid, ("", ""))[1] == session:
                self._drop(st, cid, f"abandoned version {version}: {why}")
        dead = {int(r): why for r, (inc, why) in view["dead_producers"].items()  # a stale entry for a rank that
                if inc >= st.incarnations.get(int(r), -1)}                         # rejoined since is not a death
        if dead:
            raise ProducerLost(f"producer {self.cfg.rank}, version {version}: " + "; ".join(dead.values()))
        why = view["failed"].get(version)
        if why:
            raise SyncError(f"producer {self.cfg.rank}: version {version} failed: {why}")
        if not st.done:
            self._drop_stragglers(version, st)

    def _wait(self, pred, what, version: int, st: VersionState) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        with self.cv:
            while True:
                self._prune(version, st)
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
