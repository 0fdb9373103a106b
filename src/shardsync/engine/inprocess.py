"""In-process sync: one producer (a WeightSource) feeds local consumers group by group.

Used by unit tests and as the reference the multi-process engine must agree with::

    consumers = [LocalConsumer(plan_r, params_r) for plan_r, params_r in ...]
    report = loopback_sync(ModuleSource(trainer_model), consumers, version=1)
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import msgspec
import torch

from ..errors import MetadataMismatch
from ..plan.groups import group_order
from ..plan.pack import DEFAULT_CHUNK_BYTES, GroupPacker, GroupUnpacker, check_dests, layout_group
from ..source import WeightSource, check_tensor
from ..types import Plan, metadata_digest

__all__ = ["LocalConsumer", "SyncReport", "loopback_sync"]


class SyncReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one sync moved."""

    version: int
    seconds: float
    bytes_per_consumer: list[int]
    """Payload bytes (alignment excluded) each consumer received."""
    wire_bytes_per_consumer: list[int]
    """Bytes each consumer pulled, alignment padding included."""
    groups: int


class LocalConsumer:
    """A consumer in this process: a plan plus the parameters it writes into.

    ``on_group(name)`` runs as soon as a group's slices are all in (the engine's per-layer processing).
    """

    def __init__(self, plan: Plan, params: Mapping[str, torch.Tensor], *,
                 on_group: Callable[[str], None] | None = None, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        plan.verify_digest()
        self.plan, self.params, self.on_group = plan, params, on_group
        self.layouts = {g.name: layout_group(g, max_chunk_bytes=max_chunk_bytes) for g in plan.groups}
        self.unpackers = {g.name: GroupUnpacker(g, self.layouts[g.name]) for g in plan.groups}
        check_dests(plan, params)  # fail at init, not mid-sync, if a destination is missing or differs
        self.bytes_received = 0
        self.wire_bytes_received = 0

    def receive(self, group: str, buf: torch.Tensor) -> None:
        self.unpackers[group].unpack(buf, self.params)
        self.bytes_received += self.plan.group(group).nbytes
        self.wire_bytes_received += buf.numel()
        if self.on_group is not None:
            self.on_group(group)


def loopback_sync(source: WeightSource, consumers: Sequence[LocalConsumer], *, version: int = 0) -> SyncReport:
    """Gather one group at a time from ``source``, pack it for each consumer, deliver it in-process."""
    t0 = time.perf_counter()
    metas = source.metadata()
    digest = metadata_digest(metas)
    by_name = {m.name: m for m in metas}
    for c in consumers:
        if c.plan.meta_digest != digest:
            raise MetadataMismatch(f"consumer {c.plan.consumer!r} recorded its plan against metadata "
                                   f"{c.plan.meta_digest}, the source now describes {digest}")
        c.bytes_received = c.wire_bytes_received = 0
    groups = group_order(g.name for c in consumers for g in c.plan.groups)
    for gname in groups:
        users = [c for c in consumers if gname in c.layouts]
        names = sorted({n for c in users for n in c.plan.group(gname).sources})
        full = source.gather(names)
        for n, t in full.items():
            check_tensor(by_name[n], t)
        full = {n: t.contiguous() for n, t in full.items()}
        for c in users:
            layout = c.layouts[gname]
            buf = torch.empty(layout.nbytes, dtype=torch.uint8)
            GroupPacker(c.plan.group(gname), layout).pack(full, buf)
            c.receive(gname, buf)
        del full
    return SyncReport(version=version, seconds=time.perf_counter() - t0,
                      bytes_per_consumer=[c.bytes_received for c in consumers],
                      wire_bytes_per_consumer=[c.wire_bytes_received for c in consumers], groups=len(groups))
