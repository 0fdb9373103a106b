"""The broadcast baseline users run today, for benchmarks (measured side by side with shardsync).

The only one: ``shardsync bench`` (CPU, gloo, per tensor) and ``benchmarks/gpu_sync.py`` (NCCL, per tensor and
1 GiB buckets) both time it through these functions. Every full tensor goes from the trainer rank that holds it
to every consumer (``torch.distributed`` broadcast), and each consumer loads it with its ordinary full-tensor
loader, keeping its share; the timed span covers the sender's gather and the receiver's loads (and, with
``on_group``, the per-layer process step once a layer's last tensor is loaded). One process group per producer
({producer} ∪ consumers), so PP stages broadcast their own tensors; the gather to one rank that real
frameworks add first is left out (it only helps the baseline)::

    groups = init_baseline(rank, world, port, n_producers)        # every rank, same order
    broadcast_send(source, metas, owner, rank, groups)             # producer rank
    secs, nbytes = broadcast_receive(metas, owner, groups, model.load_weights)   # consumer rank

What a consumer holds afterwards is exactly the version the producers held when they sent: the caller records it
(the local cluster checks every baseline sync byte for byte, like a shardsync one).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..plan.groups import weight_group
from ..source import WeightSource
from ..types import ParamMeta, dtype_of

__all__ = ["init_baseline", "owners", "chunks", "broadcast_send", "broadcast_receive"]


def init_baseline(rank: int, world: int, port: int, n_producers: int, *, backend: str = "gloo",
                  timeout_s: float = 120.0) -> list:
    """Join the baseline's world (producers are ranks 0..P-1) and build one group per producer."""
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    consumers = list(range(n_producers, world))
    return [dist.new_group([p, *consumers]) for p in range(n_producers)]


def owners(held: Sequence[Sequence[str]], metas: Sequence[ParamMeta]) -> dict[str, int]:
    """Which producer broadcasts each tensor: the first whose ``held`` names it."""
    out: dict[str, int] = {}
    for p, names in enumerate(held):
        for n in names:
            out.setdefault(n, p)
    missing = [m.name for m in metas if m.name not in out]
    if missing:
        raise ValueError(f"baseline: no producer holds {missing[:3]}")
    return out


def chunks(metas: Sequence[ParamMeta], owner: Mapping[str, int], bucket_bytes: int = 0
           ) -> list[tuple[int, list[ParamMeta]]]:
    """The broadcasts, in order, as (producer, tensors): one tensor each (``bucket_bytes=0``), or runs of one
    producer's consecutive tensors packed up to ``bucket_bytes`` (a tensor larger than that goes alone)."""
    out: list[tuple[int, list[ParamMeta]]] = []
    size = 0
    for m in metas:
        p = owner[m.name]
        if bucket_bytes and out and out[-1][0] == p and size + m.nbytes <= bucket_bytes:
            out[-1][1].append(m)
            size += m.nbytes
        else:
            out.append((p, [m]))
            size = m.nbytes
    return out


def _bucket(plan: list[tuple[int, list[ParamMeta]]], bucket_bytes: int, device) -> torch.Tensor | None:
    if not bucket_bytes:
        return None
    need = max((sum(m.nbytes for m in ms) for _, ms in plan if len(ms) > 1), default=0)
    return torch.empty(need, dtype=torch.uint8, device=device) if need else None


def _view(buf: torch.Tensor, off: int, m: ParamMeta) -> torch.Tensor:
    return buf[off: off + m.nbytes].view(dtype_of(m.dtype)).view(m.shape)


def _done(t0: float, device) -> float:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def broadcast_send(source: WeightSource, metas: Sequence[ParamMeta], owner: Mapping[str, int], rank: int,
                   groups: list, *, bucket_bytes: int = 0, device=None, barrier: bool = False) -> float:
    """Producer ``rank``: gather and broadcast every tensor it owns; the seconds it took. ``barrier``: every
    rank of the default group starts the clock together."""
    plan = chunks(metas, owner, bucket_bytes)
    buf = _bucket([c for c in plan if c[0] == rank], bucket_bytes, device)
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    full = source.gather([m.name for m in metas if owner[m.name] == rank])
    for p, ms in plan:
        if p != rank:
            continue
        if len(ms) == 1:
            t = full[ms[0].name]
            dist.broadcast((t if device is None else t.to(device)).contiguous(), src=rank, group=groups[rank])
            continue
        off = 0
        for m in ms:
            _view(buf, off, m).copy_(full[m.name])
            off += m.nbytes
        dist.broadcast(buf[:off], src=rank, group=groups[rank])
    return _done(t0, device)


def broadcast_receive(metas: Sequence[ParamMeta], owner: Mapping[str, int], groups: list, load_weights: Callable,
                      *, bucket_bytes: int = 0, device=None, barrier: bool = False,
                      on_group: Callable[[str], None] | None = None) -> tuple[float, int]:
    """A consumer: receive every tensor and load it with ``load_weights([(name, tensor), ...])``; ``on_group(g)``
    runs once the last tensor of weight group ``g`` is loaded. Returns (seconds, bytes received)."""
    plan = chunks(metas, owner, bucket_bytes)
    buf = _bucket(plan, bucket_bytes, device)
    left: dict[str, int] = {}
    for m in metas:
        left[weight_group(m.name)] = left.get(weight_group(m.name), 0) + 1
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    received = 0
    for p, ms in plan:
        if len(ms) == 1:
            t = torch.empty(ms[0].shape, dtype=dtype_of(ms[0].dtype), device=device)
            dist.broadcast(t, src=p, group=groups[p])
            tensors = [(ms[0].name, t)]
        else:
            n = sum(m.nbytes for m in ms)
            dist.broadcast(buf[:n], src=p, group=groups[p])
            tensors, off = [], 0
            for m in ms:
                tensors.append((m.name, _view(buf, off, m)))
                off += m.nbytes
        received += sum(t.nbytes for _, t in tensors)
        load_weights(tensors)
        if on_group is not None:
            for name, _ in tensors:
                g = weight_group(name)
                left[g] -= 1
                if left[g] == 0:
                    on_group(g)
    return _done(t0, device), received
