"""Inference side: record the plan, learn the routes, pull chunks, apply groups in the background.

The consumer's half of the schedule:

1. Groups are pulled in transfer order into a ring of ``recv_slots`` receive buffers (each the size
   of the largest group). For each group, every chunk is read from the producer routed to it, as soon
   as that producer says ``Ready``; ``Released`` goes back right after the bytes have landed (the
   producer's slot is free before this consumer has even unpacked them).
2. A full group goes to the apply thread (unpack → scatter into the engine's buffers → the engine's
   per-layer processing), which overlaps the pulls of the next groups; a receive slot is reused once
   its group has been applied.
3. Every wait is bounded by ``timeout_s``; an error in either thread ends the sync with it.

    consumer = Consumer("r0/tp1", coordinator_address, token="t", record=record_fn, apply=apply_fn)
    consumer.init()          # Hello -> record plan -> RegisterPlan -> Routes; connects transports
    consumer.sync(version=1)
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch

from . import control as m
from ..errors import SyncError, TransportError
from ..plan.pack import GroupLayout
from ..plan.route import chunk_layouts, holders_from_ownership
from ..transport import Transport, make_transport
from ..types import ParamMeta, Plan

RecordFn = Callable[[Sequence[ParamMeta]], Plan]


def _expect(reply: Any, cls: type, peer: str) -> Any:
    if not isinstance(reply, cls):
        raise TransportError(f"{peer} answered {type(reply).__name__}, expected {cls.__name__}")
    return reply
ApplyFn = Callable[[str, torch.Tensor], None]


class Consumer:
    def __init__(self, consumer_id: str, coordinator: list[Any], *, token: str, record: RecordFn, apply: ApplyFn,
                 transport: str | Transport = "tcp", transport_kwargs: dict[str, Any] | None = None,
                 timeout_s: float = 120.0, recv_slots: int = 2, init_timeout_s: float = 600.0):
        self.id, self.coordinator, self.token = consumer_id, coordinator, token
        self.record, self.apply = record, apply
        self.transport = transport if not isinstance(transport, str) else \
            make_transport(transport, **(transport_kwargs or {}))
        self.timeout_s, self.recv_slots, self.init_timeout_s = timeout_s, recv_slots, init_timeout_s
        self.stats: dict[str, Any] = {}
        self._apply_thread: threading.Thread | None = None

    def init(self) -> Plan:
        t0 = time.perf_counter()
        coord = m.ControlClient(self.coordinator, self.token, peer="coordinator (producer 0)")
        meta = _expect(coord.call(m.Hello(consumer=self.id), timeout_s=self.init_timeout_s + 5), m.TransferMeta,
                       "coordinator (producer 0)")
        metas = [ParamMeta.from_dict(d) for d in meta.metadata]
        self.metas = metas
        self.plan = self.record(metas)
        routes = _expect(coord.call(m.RegisterPlan(consumer=self.id, plan=self.plan.to_json()),
                                    timeout_s=self.init_timeout_s + 5), m.Routes, "coordinator (producer 0)")
        coord.close()
        holders = holders_from_ownership(meta.held, [x.name for x in metas])
        self.layouts: dict[str, GroupLayout] = chunk_layouts(self.plan, holders, max_chunk_bytes=meta.max_chunk_bytes)
        self.routes = routes.routes
        used = sorted({p for per in self.routes.values() for p in per})
        self.clients: dict[int, m.ControlClient] = {}
        for info in routes.producers:
            p = int(info["rank"])
            if p in used:
                self.transport.connect(p, info["desc"])
                self.clients[p] = m.ControlClient(info["address"], self.token, peer=f"producer {p}")
        slot = max((lay.nbytes for lay in self.layouts.values()), default=0)
        self.slots = [torch.empty(max(slot, 1), dtype=torch.uint8) for _ in range(self.recv_slots)]
        self.stats = {"consumer": self.id, "init_s": time.perf_counter() - t0, "plan_bytes": self.plan.nbytes,
                      "producers": used}
        return self.plan

    def sync(self, version: int) -> dict[str, Any]:
        if self._apply_thread is not None and self._apply_thread.is_alive():
            raise SyncError(f"consumer {self.id}: the previous sync's apply thread is still running; this consumer "
                            "must be re-initialised before it syncs again")
        t0 = time.perf_counter()
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
                received += self._pull_group(version, g.name, self.slots[s])
                work.put((g.name, s))
        finally:
            work.put(None)
            th.join(timeout=self.timeout_s)
        if errors:
            raise errors[0]
        if th.is_alive():
            raise SyncError(f"consumer {self.id}: applying version {version} did not finish within {self.timeout_s} s")
        self.stats.update(version=version, seconds=time.perf_counter() - t0, bytes_received=received,
                          apply_s=applied[0])
        return dict(self.stats)

    def _pull_group(self, version: int, group: str, buf: torch.Tensor) -> int:
        lay = self.layouts[group]
        per_chunk = self.routes[group]
        got = 0
        for p in sorted(set(per_chunk)):
            ready = _expect(self.clients[p].call(m.WaitReady(consumer=self.id, version=version, group=group),
                                                 timeout_s=self.timeout_s), m.Ready, f"producer {p}")
            if (ready.version, ready.group) != (version, group):
                raise SyncError(f"consumer {self.id}: producer {p} answered for group {ready.group!r} of version "
                                f"{ready.version}, asked for {group!r} of version {version}")
            mine = {i for i, q in enumerate(per_chunk) if q == p}
            if {c[0] for c in ready.chunks} != mine:
                raise SyncError(f"consumer {self.id}: producer {p} offers chunks {sorted(c[0] for c in ready.chunks)} "
                                f"of group {group!r}, routes say {sorted(mine)}")
            for ci, off, n in ready.chunks:
                c = lay.chunks[ci]
                if n != c.nbytes:
                    raise SyncError(f"consumer {self.id}: chunk {ci} of {group!r} is {n} bytes, expected {c.nbytes}")
                self.transport.read(p, off, n, buf[c.start: c.start + n], timeout_s=self.timeout_s)
                got += n
            self.clients[p].call(m.Released(consumer=self.id, version=version, group=group), timeout_s=self.timeout_s)
        return got

    def close(self, *, goodbye: bool = True) -> None:
        for c in getattr(self, "clients", {}).values():
            if goodbye:
                try:
                    c.call(m.Goodbye(consumer=self.id), timeout_s=5)
                except Exception:
                    pass
            c.close()
        self.transport.close()
