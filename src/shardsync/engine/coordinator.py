"""Init-time coordination, hosted by producer rank 0 inside its control server.

Order of events (each wait bounded by ``timeout_s``):
1. every producer ``Join``s with its address, held names and metadata digest (all must agree);
2. consumers say ``Hello`` and get the transfer metadata once all producers joined;
3. consumers ``RegisterPlan``; when all expected consumers have, routes are computed (``route.py``);
4. producers fetch their ``Assignments``, allocate and register their rings, report ``ProducerReady``;
5. consumers get their ``Routes`` (and every producer's transport descriptor).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

from . import control as m
from ..errors import MetadataMismatch, PlanError, TransportError
from ..plan.checks import check_plan
from ..plan.route import holders_from_ownership, route_plans
from ..types import ParamMeta, Plan, metadata_digest


class Coordinator:
    def __init__(self, *, metadata: Sequence[ParamMeta], n_producers: int, n_consumers: int,
                 max_chunk_bytes: int, timeout_s: float):
        self.metadata = list(metadata)
        self.digest = metadata_digest(self.metadata)
        self.n_producers, self.n_consumers = n_producers, n_consumers
        self.max_chunk_bytes, self.timeout_s = max_chunk_bytes, timeout_s
        self.cv = threading.Condition()
        self.producers: dict[int, dict[str, Any]] = {}
        self.plans: dict[str, Plan] = {}  # consumer -> plan
        self.routes: dict[str, dict[str, list[int]]] | None = None
        self.load: dict[int, int] = {}
        self.descs: dict[int, dict[str, Any]] = {}
        self.failed: Exception | None = None

    def fail(self, err: Exception) -> Exception:
        with self.cv:
            if self.failed is None:
                self.failed = err
            self.cv.notify_all()
        return err

    def _wait(self, pred: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self.cv:
            while not pred():
                if self.failed is not None:  # one peer's failure is everyone's, at once
                    raise self.failed
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"coordinator: timed out after {self.timeout_s} s waiting for {what}")
                self.cv.wait(left)

    def holders(self) -> dict[str, tuple[int, ...]]:
        held = [self.producers[p]["held"] for p in range(self.n_producers)]
        return holders_from_ownership(held, [x.name for x in self.metadata])

    def handle(self, msg: m.Msg) -> m.Msg | None:
        if isinstance(msg, m.Join):
            if msg.meta_digest != self.digest:
                raise self.fail(MetadataMismatch(
                    f"producer {msg.rank} describes metadata {msg.meta_digest[:12]}, producer 0 {self.digest[:12]}: "
                    "all trainer ranks must list the same tensors in order"))
            with self.cv:
                self.producers[msg.rank] = {"address": msg.address, "held": msg.held}
                self.cv.notify_all()
            return m.Ack()
        if isinstance(msg, m.Hello):
            self._wait(lambda: len(self.producers) == self.n_producers,
                       f"{self.n_producers} producers to join (have {sorted(self.producers)})")
            return m.TransferMeta(metadata=[x.to_dict() for x in self.metadata],
                                  held=[self.producers[p]["held"] for p in range(self.n_producers)],
                                  max_chunk_bytes=self.max_chunk_bytes)
        if isinstance(msg, m.RegisterPlan):
            plan = Plan.from_json(msg.plan)
            plan.verify_digest()
            if plan.meta_digest != self.digest:
                raise self.fail(MetadataMismatch(f"consumer {msg.consumer!r} recorded against other metadata"))
            if plan.consumer != msg.consumer:
                raise PlanError(f"consumer {msg.consumer!r} registered a plan labelled {plan.consumer!r}")
            try:  # ops allow-listed, chains replay in bounds: before anything acts on it
                check_plan(plan, self.metadata)
            except PlanError as e:  # membership is fixed: the others would wait for this consumer in vain
                raise self.fail(e) from None
            with self.cv:
                if msg.consumer in self.plans or self.routes is not None:
                    raise MetadataMismatch(f"consumer {msg.consumer!r}: registration refused (duplicate id, or "
                                           f"routes were already computed for {self.n_consumers} consumers)")
                self.plans[msg.consumer] = plan
                if len(self.plans) == self.n_consumers and self.routes is None:
                    try:
                        self._compute_routes()
                    except Exception as e:
                        raise self.fail(e) from None
                self.cv.notify_all()
            self._wait(lambda: len(self.descs) == self.n_producers,
                       f"{self.n_consumers} consumers to register plans (have {len(self.plans)}) and "
                       f"{self.n_producers} producers to register buffers (have {len(self.descs)})")
            assert self.routes is not None  # internal invariant: _wait returned after routing
            return m.Routes(routes=self.routes[plan.digest], producers=[
                {"rank": p, "address": self.producers[p]["address"], "desc": self.descs[p]}
                for p in range(self.n_producers)])
        if isinstance(msg, m.GetAssignments):
            self._wait(lambda: self.routes is not None,
                       f"{self.n_consumers} consumers to register plans (have {len(self.plans)})")
            assert self.routes is not None
            by_digest: dict[str, list[str]] = defaultdict(list)
            for c, p in sorted(self.plans.items()):
                by_digest[p.digest].append(c)
            plans = {p.digest: p for p in self.plans.values()}
            return m.Assignments(held=[self.producers[p]["held"] for p in range(self.n_producers)], plans=[plans[d].to_json() for d in sorted(plans)], routes=self.routes,
                                 consumers=dict(by_digest))
        if isinstance(msg, m.ProducerReady):
            with self.cv:
                self.descs[msg.rank] = msg.desc
                self.cv.notify_all()
            return m.Ack()
        return None

    def _compute_routes(self) -> None:
        plans = {p.digest: p for p in self.plans.values()}
        count: dict[str, int] = defaultdict(int)
        for p in self.plans.values():
            count[p.digest] += 1
        self.routes, self.load = route_plans(plans, self.holders(), count, max_chunk_bytes=self.max_chunk_bytes)
