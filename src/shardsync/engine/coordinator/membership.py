"""Who is in the group: producers and consumers with leases, and each version's member set.

The coordinator (hosted by producer 0) keeps this table; everything else learns it from replies. Rules:

1. A consumer's ``Hello`` issues a fresh session credential and starts its lease. A ``Hello`` for an id whose
   session is still live replaces it only with that session as proof; without it, it is refused
   (``SessionInUse``) until the old lease lapses — the re-admission rule for a restarted engine under its old name
   (it waits at most a lease). So no token holder can take over, or keep out, another consumer by saying ``Hello``
   with its id. A replaced session is dropped with the reason "replaced".
2. A lease is renewed by heartbeats; one not renewed for ``lease_s`` expires: the consumer is dropped
   (``dead``, with the reason), a producer is marked dead until its rank joins again (new incarnation).
3. A version's members are fixed when its first ``BeginSync`` arrives: every registered consumer whose
   lease is live then. Consumers that (re)join later receive the next version.
4. Dropped consumers stay in ``dead`` (bounded) so that every producer drops them from any version
   they are pending in, whichever producer learns it first.
5. A straggler (a live member that held a group past ``ProducerConfig.straggler_s``) leaves that version only
   (``left``, as if it had abandoned it): every producer drops it from the version, the version's outcome counts
   it dropped, and it is a member of the next version like any consumer with a live lease.

    ms = Membership(lease_s=5.0)
    s = ms.hello("r0/tp0"); ms.register("r0/tp0", s, digest)
    members = ms.begin(version=1)          # {"r0/tp0": (digest, s)}
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from ...errors import AuthError, ConsumerDropped, SessionInUse, SyncError
from ..protocol.messages import clip

__all__ = ["Membership"]

_KEEP_DEAD = 4096
_KEEP_VERSIONS = 16
AHEAD = 4
"""How far past the newest begun version a consumer may abandon (it abandons the version it is in, or the next)."""
VIEW_MAX = 512
"""Most entries of each table a ``Lease`` reply carries (the newest): a reply stays small however many peers were
dropped, whatever they sent (reasons are clipped on receipt, ``messages.MAX_REASON``)."""
VIEW_REASON = 256
"""Reasons in a ``Lease`` reply are cut to this many characters (the coordinator's log and outcomes keep more)."""


@dataclass
class _Consumer:
    session: str
    lease_until: float
    digest: str | None = None


@dataclass
class _Producer:
    incarnation: int
    address: list[Any]
    held: list[str] | None
    lease_until: float
    desc: dict[str, Any] | None = None
    ready_version: int = -2
    credential: str = ""
    node: str = ""


@dataclass
class _Version:
    members: dict[str, tuple[str, str]]
    epoch: int
    failed: str | None = None
    ready: dict[int, int] = field(default_factory=dict)  # rank -> incarnation that reported ready
    completed: set[str] = field(default_factory=set)


class Membership:
    def __init__(self, *, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.lease_s, self.clock = lease_s, clock
        self.consumers: dict[str, _Consumer] = {}
        self.producers: dict[int, _Producer] = {}
        self.dead: OrderedDict[tuple[str, str], str] = OrderedDict()  # (consumer, session) -> reason
        self.dead_producers: dict[int, tuple[int, str]] = {}  # rank -> (incarnation that died, why)
        self.versions: OrderedDict[int, _Version] = OrderedDict()
        self.failed_init: dict[str, str] = {}  # consumers that failed before registering -> reason
        self.left: OrderedDict[tuple[int, str, str], str] = OrderedDict()  # (version, consumer, session) -> why
        self.failed_early: dict[int, str] = {}  # versions failed before they began -> why

    # -------------------------------------------------------------- consumers
    DISPLACED = "displaced: another session took its id"
    """In a refusal to a session whose consumer id another session took after it was dropped (a paused engine
    that a restarted one replaced): that session must not rejoin by itself (``Consumer`` stops; re-initialise it)."""

    def hello(self, cid: str, proof: str = "") -> str:
        if cid in self.consumers:
            self.expire()
        old = self.consumers.get(cid)
        displaced = self._displaced(cid, proof) if old is None and proof else ""
        if displaced:  # a displaced session asking to rejoin (its replacement may have died since): refused
            raise ConsumerDropped(displaced)
        if old is not None and not hmac.compare_digest(proof, old.session):
            left = old.lease_until - self.clock()
            raise SessionInUse(f"consumer id {cid!r} belongs to a live session (its lease runs {left:.1f} s more): a "
                               "Hello for it must carry that session, or come once the lease has lapsed")
        if old is not None:
            self._drop(cid, old.session, "replaced: the consumer said Hello again with its session")
        session = secrets.token_hex(16)
        self.consumers[cid] = _Consumer(session, self.clock() + self.lease_s)
        self.failed_init.pop(cid, None)
        return session

    def check(self, cid: str, session: str) -> _Consumer:
        """The consumer entry, if ``session`` is its current credential (else a typed refusal)."""
        c = self.consumers.get(cid)
        if c is not None and c.session == session:
            return c
        why = self.dead.get((cid, session))
        if why is not None:
            raise ConsumerDropped(self._displaced(cid, session) or
                                  f"consumer {cid!r} was dropped ({why}); it must rejoin (Hello + RegisterPlan)")
        raise AuthError(f"session credential does not belong to consumer {cid!r}")

    def _displaced(self, cid: str, session: str) -> str:
        """The refusal for a dropped ``session`` whose id another session took since (live now, or dropped after
        it: the newest drop of ``cid`` is not this session's), else "". A session replaced by its own holder's
        ``Hello`` (it carried the session as proof) is not displaced: its successor is the same engine."""
        why = self.dead.get((cid, session))
        if why is None or why.startswith("replaced: the consumer said Hello again"):
            return ""
        if cid not in self.consumers:
            newest = next((s for c, s in reversed(self.dead) if c == cid), session)  # bounded: _KEEP_DEAD entries
            if newest == session:
                return ""
        return (f"consumer {cid!r} was dropped ({why}), then {self.DISPLACED}: this session must not rejoin by itself; "
                "re-initialise the consumer to serve again")

    def register(self, cid: str, session: str, digest: str) -> None:
        """``digest``: the consumer's route key (its plan's digest, ``@node`` where routing is node-aware)."""
        self.check(cid, session).digest = digest

    def renew_consumer(self, cid: str, session: str) -> None:
        self.expire()
        self.check(cid, session).lease_until = self.clock() + self.lease_s

    def drop(self, cid: str, session: str, reason: str) -> None:
        c = self.consumers.get(cid)
        if c is not None and c.session == session:
            if c.digest is None:
                self.failed_init[cid] = clip(reason)
                while len(self.failed_init) > _KEEP_DEAD:
                    self.failed_init.pop(next(iter(self.failed_init)))
            self._drop(cid, session, reason)

    def abandon(self, version: int, cid: str, session: str, reason: str) -> None:
        """A consumer left one version (its engine rejected or failed it); it stays a member otherwise."""
        self.check(cid, session)
        last = self._last_version()
        if not last - _KEEP_VERSIONS < version <= last + AHEAD:
            raise SyncError(f"consumer {cid!r} abandoned version {version}: only versions {last - _KEEP_VERSIONS + 1}"
                            f"..{last + AHEAD} can be abandoned now")
        self.left[(version, cid, session)] = clip(reason)
        while len(self.left) > _KEEP_DEAD:
            self.left.popitem(last=False)

    def late(self, version: int, cid: str, session: str, reason: str) -> bool:
        """A producer dropped a live member from ``version`` as a straggler (rule 5): it leaves that version only,
        like an abandon, and stays a member of the group (it takes part in the next version). False if ``cid`` with
        ``session`` is no member of ``version`` (a stale or forged report changes nothing)."""
        v = self.versions.get(version)
        if v is None or v.members.get(cid, ("", ""))[1] != session or cid in v.completed:
            return False
        self.left.setdefault((version, cid, session), clip(reason))
        while len(self.left) > _KEEP_DEAD:
            self.left.popitem(last=False)
        return True

    def _drop(self, cid: str, session: str, reason: str) -> None:
        self.consumers.pop(cid, None)
        self.dead[(cid, session)] = clip(reason)
        while len(self.dead) > _KEEP_DEAD:
            self.dead.popitem(last=False)

    def expire(self) -> None:
        now = self.clock()
        for cid, c in list(self.consumers.items()):
            if now > c.lease_until:
                self.drop(cid, c.session, f"lease expired: no heartbeat for {self.lease_s:g} s")
        for r, p in self.producers.items():
            if r != 0 and r not in self.dead_producers and now > p.lease_until:
                self.dead_producers[r] = (p.incarnation, f"producer {r} (incarnation {p.incarnation}) lease expired: "
                                                         f"no heartbeat for {self.lease_s:g} s")

    # -------------------------------------------------------------- producers
    def join(self, rank: int, address: list[Any], held: list[str] | None, node: str = "") -> tuple[int, str]:
        """(incarnation, credential) of the rank's new incarnation."""
        old = self.producers.get(rank)
        inc = 0 if old is None else old.incarnation + 1
        cred = secrets.token_hex(16)
        self.producers[rank] = _Producer(inc, address, held, self.clock() + self.lease_s, node=node, credential=cred)
        self.dead_producers.pop(rank, None)
        return inc, cred

    def proven(self, rank: int, incarnation: int, credential: str) -> _Producer:
        """The producer, if ``credential`` is its current incarnation's (else ``AuthError``)."""
        p = self.producer(rank, incarnation)
        if not credential or not hmac.compare_digest(p.credential, credential):
            raise AuthError(f"producer {rank}: the credential of incarnation {incarnation} does not match")
        return p

    def on_route(self, version: int, cid: str, session: str, producer: int,
                 routes: dict[str, dict[str, list[int]]] | None) -> bool:
        """Whether ``cid`` with ``session`` is a member of ``version`` whose routes pull from ``producer``."""
        v = self.versions.get(version)
        c = self.consumers.get(cid)
        if v is None or c is None or v.members.get(cid, ("", ""))[1] != session or routes is None:
            return False
        return any(producer in per for per in routes.get(v.members[cid][0], {}).values())

    def producer(self, rank: int, incarnation: int) -> _Producer:
        p = self.producers.get(rank)
        if p is None or p.incarnation != incarnation:
            raise AuthError(f"producer {rank} incarnation {incarnation} is not current (a restarted rank replaced it)")
        return p

    def renew_producer(self, rank: int, incarnation: int) -> None:
        self.expire()
        p = self.producer(rank, incarnation)
        if rank in self.dead_producers:
            raise ConsumerDropped(f"producer {rank}: {self.dead_producers[rank][1]}; it must join again")
        p.lease_until = self.clock() + self.lease_s

    def producer_ready(self, rank: int, incarnation: int, version: int, desc: dict[str, Any]) -> None:
        p = self.producer(rank, incarnation)
        p.desc, p.ready_version = desc, version
        if version >= 0:
            self.version(version).ready[rank] = incarnation

    # -------------------------------------------------------------- versions
    def begin(self, version: int, epoch: int) -> _Version:
        self.expire()
        v = self.versions.get(version)
        if v is None:
            members = {cid: (c.digest, c.session) for cid, c in self.consumers.items() if c.digest is not None}
            v = self.versions[version] = _Version(members, epoch, failed=self.failed_early.pop(version, None))
            for old in [n for n in self.failed_early if n < version]:  # for versions that never began
                del self.failed_early[old]
            while len(self.versions) > _KEEP_VERSIONS:
                self.versions.popitem(last=False)
        return v

    def version(self, version: int) -> _Version:
        v = self.versions.get(version)
        if v is None:
            raise ConsumerDropped(f"version {version} has not begun (or is too old)")
        return v

    def fail_version(self, version: int, reason: str) -> None:
        """Fail ``version`` for everyone — also one not begun yet (a rank that cannot take part in it says so
        first): it then begins failed. Early failures are kept for the next ``AHEAD`` versions only."""
        v = self.versions.get(version)
        if v is not None:
            if v.failed is None:
                v.failed = clip(reason)
            return
        last = self._last_version()
        if last < version <= last + AHEAD:
            self.failed_early.setdefault(version, clip(reason))

    def outcome(self, version: int) -> dict[str, Any]:
        """Who completed ``version``, who was dropped from it (and why), whether it failed; ``done`` once every
        member is accounted for."""
        self.expire()
        v = self.version(version)
        dropped = {}
        for cid, (_, session) in v.members.items():
            why = self.left.get((version, cid, session)) or self.dead.get((cid, session))
            if why is not None and cid not in v.completed:
                dropped[cid] = why
        done = bool(v.failed) or len(v.completed) + len(dropped) >= len(v.members)
        return {"done": done, "completed": sorted(v.completed), "dropped": dropped, "failed": v.failed or ""}

    def lease_view(self) -> dict[str, Any]:
        """What every heartbeat's reply carries: the newest ``VIEW_MAX`` drops, the abandons of versions still
        tracked (the last ``_KEEP_VERSIONS``), failed versions — each reason cut to ``VIEW_REASON``."""
        self.expire()
        dead = list(self.dead.items())[-VIEW_MAX:]
        left = [e for e in self.left.items() if e[0][0] in self.versions or e[0][0] > self._last_version()]
        return {"dead": [[c, s, clip(why, VIEW_REASON)] for (c, s), why in dead],
                "dead_producers": {r: [d[0], clip(d[1], VIEW_REASON)] for r, d in self.dead_producers.items()},
                "left": [[v, c, s, clip(why, VIEW_REASON)] for (v, c, s), why in left[-VIEW_MAX:]],
                "failed": {n: clip(v.failed, VIEW_REASON) for n, v in self.versions.items() if v.failed}}

    def _last_version(self) -> int:
        return next(reversed(self.versions), 0) if self.versions else 0
