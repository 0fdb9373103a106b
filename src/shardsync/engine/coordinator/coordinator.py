"""Coordination, hosted by producer 0 inside its control server: init, membership, each version's start.

Init (each wait bounded by ``init_timeout_s`` and naming who is missing):

1. every producer ``Join``s with its address, held names and metadata digest (all must agree);
2. consumers say ``Hello`` (session credential, lease starts) and get the transfer metadata once all
   producers joined; they record their plans and ``RegisterPlan`` (checked: ops allow-listed, views in
   bounds, sizes bounded by the model — a forged plan is refused naming the consumer);
3. routes are computed once all ``n_consumers`` registered, or once ``min_consumers`` did and
   ``join_grace_s`` passed; the quorum counts registered plans only: consumers that fail to start
   (``InitFailed``, or a lease that expires before a plan is registered — a junk Hello's too) end init early
   only once the grace has passed, nobody is still recording and registered plus failed fill every slot;
   else init waits (``init_timeout_s``, naming them);
4. producers fetch their ``Assignments``, allocate and register their rings, report ``ProducerReady``.

After init, a consumer that (re)joins is routed on registration (a known plan digest reuses its
routes; a new one is routed against the current load and bumps the assignment ``epoch``, which
producers pick up at their next sync). Every version starts with ``BeginSync``: its member set is
fixed then (``membership.py``); a consumer's ``BeginSync`` returns once the producers it pulls from
have reported ready for that version (their current address and transport descriptor).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

from ..protocol import messages as m
from .membership import Membership
from ...errors import MetadataMismatch, NotMember, PlanError, ProducerLost, SyncError, TransportError
from ...plan.checks import check_plan, max_scatters
from ...plan.groups import weight_group
from ...plan.route import digest_of, holders_from_ownership, route_key, route_plans
from ...types import ParamMeta, Plan, metadata_digest


def _payload(plan: Plan) -> int:
    """Bytes a plan has producers pack each sync (from its scatters: a plan's own byte counts are not trusted)."""
    return sum(s.nbytes for g in plan.groups for s in g.scatters)


MAX_ROUTED_COPIES = 64
"""Default bound of all routed plans together, in copies of the model (``ProducerConfig.max_routed_bytes``)."""
MAX_SLOT_GROUPS = 4
"""Default bound of one group over all routed plans, in copies of the model's largest weight group
(``ProducerConfig.max_group_bytes``): room for four distinct layouts (TP degrees) of every group at once."""


def group_bytes(plans: Sequence[Plan]) -> dict[str, int]:
    """Group -> the bytes every plan together has packed for it each sync: what one ring slot holds (from the
    scatters: a plan's own byte counts are not trusted)."""
    out: dict[str, int] = defaultdict(int)
    for plan in plans:
        for g in plan.groups:
            out[g.name] += sum(s.nbytes for s in g.scatters)
    return dict(out)


def group_sources(plans: Sequence[Plan], nbytes: dict[str, int]) -> dict[str, int]:
    """Group -> full-tensor bytes of the distinct sources the plans read for it: what a producer gathers at once."""
    srcs: dict[str, set[str]] = defaultdict(set)
    for plan in plans:
        for g in plan.groups:
            srcs[g.name].update(s.src for s in g.scatters)
    return {g: sum(nbytes.get(n, 0) for n in names) for g, names in srcs.items()}


class Coordinator:
    def __init__(self, *, metadata: Sequence[ParamMeta], n_producers: int, n_consumers: int,
                 max_chunk_bytes: int, timeout_s: float, init_timeout_s: float, lease_s: float,
                 min_consumers: int | None = None, join_grace_s: float = 30.0,
                 max_routed_bytes: int | None = None, max_group_bytes: int | None = None, mac: bool = False):
        self.metadata = list(metadata)
        self.mac = mac
        """Rank 0 runs with ``ProducerConfig.mac``: every rank must (a rank that differs fails init, naming it)."""
        model_bytes = max(sum(x.nbytes for x in self.metadata), 1)
        self.max_routed_bytes = MAX_ROUTED_COPIES * model_bytes if max_routed_bytes is None else max_routed_bytes
        """What all routed plans together may carry per sync (each route key's plan counted once): the bound on
        what producers pack. Past it a consumer's plan is refused, naming it."""
        whole: dict[str, int] = defaultdict(int)
        for x in self.metadata:
            whole[weight_group(x.name)] += x.nbytes
        self.max_group_bytes = MAX_SLOT_GROUPS * max(whole.values(), default=1) if max_group_bytes is None \
            else max_group_bytes
        """What one group may carry over all routed plans, and what its sources may weigh: the bound on a ring slot
        (a slot holds one group of every plan) and on a producer's gather peak. Past it a plan is refused."""
        self.nbytes = {x.name: x.nbytes for x in self.metadata}
        self.digest = metadata_digest(self.metadata)
        self.n_producers, self.n_consumers = n_producers, n_consumers
        self.min_consumers = n_consumers if min_consumers is None else min_consumers
        self.max_chunk_bytes, self.timeout_s, self.init_timeout_s = max_chunk_bytes, timeout_s, init_timeout_s
        self.join_grace_s, self.lease_s = join_grace_s, lease_s
        self.ms = Membership(lease_s=lease_s)
        self.cv = threading.Condition()
        self.t_start = time.monotonic()
        self.plans: dict[str, Plan] = {}  # digest -> plan
        self.routes: dict[str, dict[str, list[int]]] | None = None
        self.load: dict[int, int] = {}
        self.epoch = 0
        self.failed: Exception | None = None

    def fail(self, err: Exception) -> Exception:
        with self.cv:
            if self.failed is None:
                self.failed = err
            self.cv.notify_all()
        return err

    def _wait(self, pred: Callable[[], bool], what: Callable[[], str], timeout_s: float, *, init: bool) -> None:
        """Wait (holding ``cv``) until ``pred``; leases are checked and init routing retried while waiting."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.ms.expire()
            if init:
                self._maybe_route()
            if pred():
                return
            if init and self.failed is not None:  # one peer's init failure is everyone's, at once
                raise self.failed
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"coordinator: timed out after {timeout_s} s waiting for {what()}")
            self.cv.wait(min(left, 0.25))

    def holders(self) -> dict[str, tuple[int, ...]]:
        held = [self.ms.producers[p].held for p in range(self.n_producers)]
        return holders_from_ownership(held, [x.name for x in self.metadata])

    refusals: Callable[[], str] | None = None
    """The control server's wrong-token refusals (``ControlServer.refusals``), named while the quorum is missing."""

    def _missing(self) -> str:
        reg = sorted(c for c, e in self.ms.consumers.items() if e.digest is not None)
        rec = sorted(c for c, e in self.ms.consumers.items() if e.digest is None)
        unseen = max(0, self.n_consumers - len(reg) - len(rec) - len(self.ms.failed_init))
        refused = self.refusals() if self.refusals is not None else ""
        return (f"consumers to register plans: need {self.n_consumers} (quorum {self.min_consumers}); registered "
                f"{reg}; recording {rec}; failed {self.ms.failed_init}; not heard from: {unseen}"
                + (f"; refused: {refused}" if refused else ""))

    def _maybe_route(self) -> None:
        if self.routes is not None or self.failed is not None or len(self.ms.producers) < self.n_producers:
            return
        reg = {c: e.digest for c, e in self.ms.consumers.items() if e.digest is not None}
        grace = time.monotonic() - self.t_start >= self.join_grace_s
        failed = self.ms.failed_init
        recording = any(e.digest is None for e in self.ms.consumers.values())
        if failed and len(reg) < self.min_consumers and grace and not recording \
                and len(reg) + len(failed) >= self.n_consumers:
            # the quorum counts registered plans only: a failure (or a junk Hello's lapsed lease) ends init early
            # only once the grace has passed with nobody still recording and every slot accounted for
            self.failed = SyncError(f"coordinator: init cannot reach its quorum of {self.min_consumers} consumers "
                                    f"(registered {sorted(reg)}): "
                                    + "; ".join(f"{c} failed: {r}" for c, r in sorted(failed.items())))
            self.cv.notify_all()
            return
        if len(reg) < self.n_consumers and not (grace and len(reg) >= self.min_consumers):
            return
        count: dict[str, int] = defaultdict(int)
        for k in reg.values():
            count[k] += 1
        try:
            self.routes, self.load = route_plans({k: self.plans[digest_of(k)] for k in count}, self.holders(), count,
                                                 max_chunk_bytes=self.max_chunk_bytes, prefer=self._prefer(count))
        except Exception as e:
            self.failed = e
        self.cv.notify_all()

    # ------------------------------------------------------------------ messages
    def handle(self, msg: m.Msg) -> m.Msg | None:
        h = getattr(self, f"_on_{type(msg).__name__}", None)
        return None if h is None else h(msg)

    def _on_Join(self, msg: m.Join) -> m.Msg:
        if msg.meta_digest != self.digest:
            raise self.fail(MetadataMismatch(
                f"producer {msg.rank} describes metadata {msg.meta_digest[:12]}, producer 0 {self.digest[:12]}: "
                "all trainer ranks must list the same tensors in order"))
        if not 0 <= msg.rank < self.n_producers:
            raise MetadataMismatch(f"producer rank {msg.rank} is outside 0..{self.n_producers - 1}")
        if msg.mac != self.mac:
            raise self.fail(SyncError(
                f"producer {msg.rank} runs with mac={msg.mac}, producer 0 with mac={self.mac}: every trainer rank "
                "of a group must be given the same ProducerConfig.mac"))
        with self.cv:
            inc, cred = self.ms.join(msg.rank, msg.address, msg.held, msg.node)
            self.cv.notify_all()
        return m.Joined(incarnation=inc, credential=cred)

    def _on_Renew(self, msg: m.Renew) -> m.Msg:
        with self.cv:
            if msg.consumer:
                self.ms.renew_consumer(msg.consumer, msg.session)
            else:
                self.ms.renew_producer(msg.rank, msg.incarnation)
            return m.Lease(**self.ms.lease_view())

    def _on_Hello(self, msg: m.Hello) -> m.Msg:
        with self.cv:
            session = self.ms.hello(msg.consumer, msg.session)
            self._wait(lambda: len(self.ms.producers) == self.n_producers,
                       lambda: f"{self.n_producers} producers to join (have {sorted(self.ms.producers)})",
                       self.init_timeout_s, init=True)
            held = [self.ms.producers[p].held for p in range(self.n_producers)]
        return m.Welcome(session=session, metadata=[x.to_dict() for x in self.metadata], held=held,
                         max_chunk_bytes=self.max_chunk_bytes, lease_s=self.lease_s)

    def _on_InitFailed(self, msg: m.InitFailed) -> m.Msg:
        with self.cv:
            self.ms.drop(msg.consumer, msg.session, f"failed to start: {msg.reason}")
            self._maybe_route()
            self.cv.notify_all()
        return m.Ack()

    def _on_RegisterPlan(self, msg: m.RegisterPlan) -> m.Msg:
        plan = Plan.from_json(msg.plan)
        plan.verify_digest()
        if plan.meta_digest != self.digest:
            raise MetadataMismatch(f"consumer {msg.consumer!r} recorded against other metadata")
        if plan.consumer != msg.consumer:
            raise PlanError(f"consumer {msg.consumer!r} registered a plan labelled {plan.consumer!r}")
        with self.cv:
            self.ms.check(msg.consumer, msg.session)
        if plan.digest not in self.plans:
            check_plan(plan, self.metadata)  # a forged plan is refused here, naming the consumer
        if len(msg.node) > 128 or "@" in msg.node:
            raise PlanError(f"consumer {msg.consumer!r}: node name {msg.node[:40]!r}... is not a node id (at most 128 "
                            "characters, no '@')")
        key = route_key(plan.digest, msg.node)
        with self.cv:
            self._check_budget(msg.consumer, key, plan)
            self.ms.register(msg.consumer, msg.session, key)
            self.plans.setdefault(plan.digest, plan)
            if self.routes is not None and key not in self.routes:  # a rejoiner with a new plan (or node): route it
                self._route_late(plan, key)                          # against the current load
            self.cv.notify_all()
            self._wait(lambda: self.routes is not None, self._missing, self.init_timeout_s, init=True)
            assert self.routes is not None  # internal invariant: _wait returned after routing
            return m.Routes(routes=self.routes[key])

    def _keys(self) -> set[str]:
        """Route keys in use: routed ones, and (before routing) registered consumers'."""
        if self.routes is not None:
            return set(self.routes)
        return {e.digest for e in self.ms.consumers.values() if e.digest is not None}

    def _check_budget(self, consumer: str, key: str, plan: Plan) -> None:
        keys = self._keys()
        if key in keys:
            return
        self._prune_routes()
        keys = self._keys()
        plans = [self.plans[d] for d in {digest_of(k) for k in keys} if d in self.plans]
        total = sum(_payload(p) for p in plans) + _payload(plan)
        if total > self.max_routed_bytes:
            raise PlanError(f"consumer {consumer!r}: its plan ({_payload(plan)} bytes a sync) would make the group's "
                            f"routed plans carry {total} bytes a sync ({len(keys) + 1} route keys), over the budget of "
                            f"{self.max_routed_bytes} (ProducerConfig.max_routed_bytes)")
        if plan.digest not in {p.digest for p in plans}:
            plans.append(plan)
        scatters = sum(len(g.scatters) for p in plans for g in p.groups)
        if scatters > MAX_ROUTED_COPIES * max_scatters(len(self.metadata)) // 4:
            raise PlanError(f"consumer {consumer!r}: with its plan the routed plans would have {scatters} scatters, "
                            f"more than {MAX_ROUTED_COPIES // 4}x what one plan may have "
                            f"({max_scatters(len(self.metadata))}): producers pack per scatter")
        for what, per in (("gather sources of", group_sources(plans, self.nbytes)), ("carry", group_bytes(plans))):
            g, most = max(per.items(), key=lambda kv: kv[1], default=("", 0))
            if most > self.max_group_bytes:
                own = group_bytes([plan]).get(g, 0) if what == "carry" else group_sources([plan], self.nbytes).get(g, 0)
                raise PlanError(f"consumer {consumer!r}: with its plan ({own} bytes of group {g!r}) the routed plans "
                                f"would {what} {most} bytes in group {g!r}, over the bound of {self.max_group_bytes} "
                                "on one group (ProducerConfig.max_group_bytes: a ring slot and a gather hold a group "
                                "of every plan)")

    def _prune_routes(self) -> None:
        """Drop the route keys (and plans) no live consumer uses any more: producers stop packing for consumers that
        left (they re-fetch their assignments: the epoch moves)."""
        if self.routes is None:
            return
        live = {e.digest for e in self.ms.consumers.values() if e.digest is not None}
        stale = [k for k in self.routes if k not in live]
        if not stale:
            return
        for k in stale:
            del self.routes[k]
        used = {digest_of(k) for k in self.routes}
        for d in [d for d in self.plans if d not in used]:
            del self.plans[d]
        self.epoch += 1

    def _prefer(self, keys) -> dict[str, frozenset[int]]:
        """Route key -> the producers on that key's node (rule 5 of ``plan/route.py``)."""
        out = {}
        for k in keys:
            node = k.partition("@")[2]
            if node:
                out[k] = frozenset(r for r, p in self.ms.producers.items() if p.node == node)
        return out

    def _route_late(self, plan: Plan, key: str) -> None:
        assert self.routes is not None
        routes, load = route_plans({key: plan}, self.holders(), {key: 1}, max_chunk_bytes=self.max_chunk_bytes,
                                   base_load=self.load, prefer=self._prefer([key]))
        self.routes.update(routes)
        self.load = load
        self.epoch += 1

    def _on_GetAssignments(self, msg: m.GetAssignments) -> m.Msg:
        with self.cv:
            self._wait(lambda: self.routes is not None, self._missing, self.init_timeout_s, init=True)
            assert self.routes is not None
            return m.Assignments(held=[self.ms.producers[p].held for p in range(self.n_producers)],
                                 plans=[self.plans[d].to_json() for d in sorted({digest_of(k) for k in self.routes})],
                                 routes=dict(self.routes), epoch=self.epoch)

    def _on_ProducerReady(self, msg: m.ProducerReady) -> m.Msg:
        with self.cv:
            self.ms.producer_ready(msg.rank, msg.incarnation, msg.version, msg.desc)
            self.cv.notify_all()
        return m.Ack()

    def _on_SyncFailed(self, msg: m.SyncFailed) -> m.Msg:
        with self.cv:
            self.ms.proven(msg.rank, msg.incarnation, msg.credential)  # only the rank itself fails a version
            self.ms.fail_version(msg.version, f"producer {msg.rank}: {msg.reason}")
            self.cv.notify_all()
        return m.Ack()

    def _on_Straggler(self, msg: m.Straggler) -> m.Msg:
        with self.cv:
            self.ms.proven(msg.rank, msg.incarnation, msg.credential)  # only a current producer rank drops a member
            if self.ms.late(msg.version, msg.consumer, msg.session, f"producer {msg.rank}: {msg.reason}"):
                self.cv.notify_all()
        return m.Ack()

    def _on_Abandon(self, msg: m.Abandon) -> None:
        with self.cv:
            self.ms.abandon(msg.version, msg.consumer, msg.session, msg.reason)
            if msg.lost_producer >= 0 and self.ms.on_route(msg.version, msg.consumer, msg.session, msg.lost_producer,
                                                           self.routes):  # only a member pulling from it
                self.ms.fail_version(msg.version, f"consumer {msg.consumer} lost producer {msg.lost_producer}: "
                                                  f"{msg.reason}")
            self.cv.notify_all()
        return None  # producer 0's own serving side handles it too

    def _on_Completed(self, msg: m.Completed) -> m.Msg:
        with self.cv:
            self.ms.check(msg.consumer, msg.session)
            v = self.ms.version(msg.version)
            if v.members.get(msg.consumer, ("", ""))[1] != msg.session:
                raise NotMember(f"consumer {msg.consumer!r} is not a member of version {msg.version}")
            v.completed.add(msg.consumer)
            self.cv.notify_all()
        return m.Ack()

    def outcome(self, version: int, wait_s: float) -> m.Outcome:
        """The version's outcome, waiting up to ``wait_s`` for it to be decided."""
        deadline = time.monotonic() + wait_s
        with self.cv:
            while True:
                o = self.ms.outcome(version)
                left = deadline - time.monotonic()
                if o["done"] or left <= 0:
                    return m.Outcome(**o)
                self.cv.wait(min(left, 0.25))

    def _on_AwaitVersion(self, msg: m.AwaitVersion) -> m.Msg:
        with self.cv:
            self.ms.producer(msg.rank, msg.incarnation)
        return self.outcome(msg.version, min(1.0, self.lease_s / 4))

    def _on_Goodbye(self, msg: m.Goodbye) -> m.Msg:
        with self.cv:
            self.ms.check(msg.consumer, msg.session)  # only a consumer itself may say goodbye
            self.ms.drop(msg.consumer, msg.session, "said goodbye")
            self.cv.notify_all()
        return m.Ack()

    def _on_Evict(self, msg: m.Evict) -> m.Msg:
        """Any holder of the group's token (an orchestrator watching engine processes) may report consumers dead:
        they are dropped from the version in progress at once, like an expired lease; a restarted one rejoins."""
        with self.cv:
            for cid in msg.consumers[:4096]:
                c = self.ms.consumers.get(cid)
                if c is not None:
                    self.ms.drop(cid, c.session, f"evicted: {msg.reason[:500]}")
            self.cv.notify_all()
        return m.Ack()

    def _on_BeginSync(self, msg: m.BeginSync) -> m.Msg:
        with self.cv:
            if msg.consumer:
                self.ms.check(msg.consumer, msg.session)
            else:
                self.ms.producer(msg.rank, msg.incarnation)
            if msg.version not in self.ms.versions:  # a new version: nothing is packed for consumers that left
                self.ms.expire()
                self._prune_routes()
            v = self.ms.begin(msg.version, self.epoch)
            self.cv.notify_all()
            members = {c: list(ds) for c, ds in v.members.items()}
            if not msg.consumer:
                return m.SyncView(version=msg.version, members=members, epoch=v.epoch, producers=[
                    {"rank": r, "incarnation": p.incarnation} for r, p in sorted(self.ms.producers.items())])
            if msg.consumer not in v.members or v.members[msg.consumer][1] != msg.session:
                raise NotMember(f"consumer {msg.consumer!r} (re)joined after version {msg.version} began; it "
                                "receives the next version")
            assert self.routes is not None
            used = sorted({p for per in self.routes[v.members[msg.consumer][0]].values() for p in per})

            def ready() -> bool:
                if v.failed:
                    raise SyncError(f"version {msg.version} failed: {v.failed}")
                dead = [r for r in used if r in self.ms.dead_producers]
                if dead:
                    raise ProducerLost(f"version {msg.version}: " + "; ".join(self.ms.dead_producers[r][1] for r in dead))
                return all(v.ready.get(r) == self.ms.producers[r].incarnation for r in used)

            try:  # at most a lease per call: the consumer asks again (so a stopped coordinator shows within it)
                self._wait(ready, lambda: "", min(self.timeout_s, self.lease_s), init=False)
            except TransportError:
                return m.Pending()
            return m.SyncView(version=msg.version, members={msg.consumer: members[msg.consumer]}, epoch=v.epoch,
                              producers=[{"rank": r, "incarnation": self.ms.producers[r].incarnation,
                                          "address": self.ms.producers[r].address, "desc": self.ms.producers[r].desc}
                                         for r in used])

    def lease_view(self) -> dict[str, Any]:
        with self.cv:
            return self.ms.lease_view()
