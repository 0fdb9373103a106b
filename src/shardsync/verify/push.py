"""Trainer side for the driver-process path: read the workers' plans, pack one update per rank.

    plans = read_plans(plan_dir, world_size)
    llm.update_weights({"update_info": pack_updates(plans, source, version=1)})
"""

from __future__ import annotations

import os
import time

import torch

from ..errors import MetadataMismatch, TransportError
from ..plan.groups import group_order
from ..plan.pack import GroupPacker, layout_group
from ..source import WeightSource, check_tensor
from ..types import Plan, metadata_digest


def read_plans(plan_dir: str, world_size: int, *, timeout_s: float = 60.0) -> list[Plan]:
    """The plans workers wrote at init (waits up to ``timeout_s`` for each file)."""
    plans = []
    for r in range(world_size):
        path = os.path.join(plan_dir, f"plan_rank{r}.json")
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TransportError(f"no plan from worker rank {r} at {path} after {timeout_s:.0f} s")
            time.sleep(0.1)
        with open(path, "rb") as f:
            plan = Plan.from_json(f.read())
        plan.verify_digest()
        plans.append(plan)
    return plans


def pack_updates(plans: list[Plan], source: WeightSource, *, version: int) -> list[dict]:
    """One ``update_info`` dict per worker rank: its groups, packed from the source's full tensors,
    gathering one weight group at a time."""
    metas = source.metadata()
    digest = metadata_digest(metas)
    by_name = {m.name: m for m in metas}
    for p in plans:
        if p.meta_digest != digest:
            raise MetadataMismatch(f"plan {p.consumer!r} was recorded against other metadata ({p.meta_digest[:12]} "
                                   f"vs {digest[:12]})")
    out = [{"version": version, "plan_digest": p.digest, "groups": []} for p in plans]
    for gname in group_order(g.name for p in plans for g in p.groups):
        names = sorted({n for p in plans for g in p.groups if g.name == gname for n in g.sources})
        full = source.gather(names)
        for n, t in full.items():
            check_tensor(by_name[n], t)
        full = {n: t.contiguous() for n, t in full.items()}
        for p, upd in zip(plans, out):
            if not any(g.name == gname for g in p.groups):
                continue
            g = p.group(gname)
            layout = layout_group(g)
            buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
            GroupPacker(g, layout).pack(full, buf)
            upd["groups"].append([gname, buf.numpy().tobytes()])
    return out
