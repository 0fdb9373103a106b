"""The broadcast baseline users run today, for benchmarks (measured side by side with shardsync).

Every full tensor goes from the trainer rank that holds it to every consumer (``torch.distributed``
broadcast, gloo on CPU), and each consumer loads it with its ordinary full-tensor loader, keeping
its share. One process group per producer ({producer} ∪ consumers), so PP stages broadcast their own
tensors; the gather to one rank that real frameworks add first is left out (it only helps the
baseline)::

    groups = baseline_groups(n_producers, n_consumers)      # every rank calls this, same order
    broadcast_send(source, metas, owners, rank, groups)      # producer rank
    broadcast_receive(metas, owners, groups, model.load_weights)   # consumer rank
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..source import WeightSource
from ..types import ParamMeta, dtype_of


def init_baseline(rank: int, world: int, port: int, n_producers: int, *, timeout_s: float = 120.0) -> list:
    """Join the baseline's gloo world (producers are ranks 0..P-1) and build one group per producer."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    consumers = list(range(n_producers, world))
    return [dist.new_group([p, *consumers]) for p in range(n_producers)]


def owners(held: Sequence[Sequence[str]], metas: Sequence[ParamMeta]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p, names in enumerate(held):
        for n in names:
            out.setdefault(n, p)
    missing = [m.name for m in metas if m.name not in out]
    if missing:
        raise ValueError(f"baseline: no producer holds {missing[:3]}")
    return out


def broadcast_send(source: WeightSource, metas: Sequence[ParamMeta], owner: Mapping[str, int], rank: int,
                   groups: list) -> float:
    t0 = time.perf_counter()
    mine = [m.name for m in metas if owner[m.name] == rank]
    full = source.gather(mine)
    for n in mine:
        dist.broadcast(full[n].contiguous(), src=rank, group=groups[rank])
    return time.perf_counter() - t0


def broadcast_receive(metas: Sequence[ParamMeta], owner: Mapping[str, int], groups: list,
                      load_weights: Callable) -> tuple[float, int]:
    t0 = time.perf_counter()
    received = 0
    for m in metas:
        t = torch.empty(m.shape, dtype=dtype_of(m.dtype))
        dist.broadcast(t, src=owner[m.name], group=groups[owner[m.name]])
        received += t.nbytes
        load_weights([(m.name, t)])
    return time.perf_counter() - t0, received
