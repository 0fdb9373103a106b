"""Reading a plan's writes back out of the parameters: the packed bytes of a chunk, made again from the engine.

A delta consumer patches the bytes it last received. Where a layer is written directly (its first-load processing
is the identity) its parameters hold those bytes already: packed again from them, they are the delta's base, and
no held copy is needed (``delta/receiver.py``). That is exact only for a scatter whose region is its own:

1. its parameter is one the caller vouches for (``eligible``: nothing processes or rewrites it after the copy);
2. no other write of the plan — a scatter or fill of any group, into any parameter — touches its bytes (tied
   parameters sharing a storage, a fill under it, interleaved layouts); byte extents are compared, so a strided
   region that only interleaves with another counts as touching it (conservative);
3. it maps every element to bytes of its own (no stride 0 or self-overlapping dimensions);
4. the plan has no fallback tensors (a whole tensor handed to the engine's own loader writes what the plan does
   not say).

Pure; the copies themselves are ``GroupUnpacker.read_back`` (``plan/pack.py``)::

    ok = readable_scatters(plan, params, eligible={"model.norm.weight", ...})   # {group: frozenset(scatter index)}
    rb = ParamsReadBack(plan, params, eligible)
    rb.read_back("model.layers.0", chunk, dst)        # dst: the chunk's bytes, as the producer packs them
"""

from __future__ import annotations

from collections import defaultdict
from typing import Collection, Mapping

import torch

from ..types import Plan, Scatter, Fill, dtype_of
from .pack import Chunk, GroupUnpacker, layout_group

__all__ = ["readable_scatters", "own_region", "ParamsReadBack"]


def own_region(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Every index of ``shape`` reaches an element of its own under ``stride`` (sorted by stride, each dimension
    steps past everything the smaller ones span)."""
    dims = sorted((st, n) for n, st in zip(shape, stride) if n > 1)
    span = 0  # elements the dimensions so far reach past the first
    for st, n in dims:
        if st <= span:
            return False
        span += (n - 1) * st
    return True


def _extent(param: torch.Tensor, w: Scatter | Fill) -> tuple[int, int, int] | None:
    """(storage, first byte, one past the last byte) of the region ``w`` writes in ``param``; None if empty."""
    if any(n == 0 for n in w.shape):
        return None
    size = dtype_of(w.dst_dtype).itemsize
    lo = param.storage_offset() * param.element_size() + w.dst_byte_offset
    last = sum((n - 1) * st for n, st in zip(w.shape, w.dst_stride))
    return param.untyped_storage().data_ptr(), lo, lo + (last + 1) * size


def readable_scatters(plan: Plan, params: Mapping[str, torch.Tensor],
                      eligible: Collection[str]) -> dict[str, frozenset[int]]:
    """Per group, the scatters whose bytes can be read back from ``params`` as they were written (the module
    docstring's rules). ``params``: every parameter the plan writes (one missing leaves its writes' bytes unknown, so
    none is proved alone: the answer is empty); ``eligible``: the parameters nothing rewrites after the copy."""
    if plan.fallback:
        return {}
    writes: dict[int, list[tuple[int, int, str, int]]] = defaultdict(list)
    for g in plan.groups:
        for i, w in [*enumerate(g.scatters), *((-1, f) for f in g.fills)]:  # a fill: -1, never readable itself
            p = params.get(w.dst)
            if p is None:  # a write into a tensor not given: who else it touches is unknown
                return {}
            ext = _extent(p, w)
            if ext is not None:
                writes[ext[0]].append((ext[1], ext[2], g.name, i))
    ok: dict[str, set[int]] = defaultdict(set)
    for spans in writes.values():
        spans.sort()
        end = -1  # one past the furthest byte of the writes before
        for k, (lo, hi, g, i) in enumerate(spans):
            alone = lo >= end and (k + 1 == len(spans) or spans[k + 1][0] >= hi)
            end = max(end, hi)
            if alone and i >= 0:
                ok[g].add(i)
    out: dict[str, frozenset[int]] = {}
    names = set(eligible)
    for g in plan.groups:
        keep = frozenset(i for i in ok.get(g.name, ()) if g.scatters[i].dst in names
                         and own_region(g.scatters[i].shape, g.scatters[i].dst_stride))
        if keep:
            out[g.name] = keep
    return out


class ParamsReadBack:
    """What a delta consumer asks of an engine that writes ``params`` directly (``Consumer(read_back=)``): which
    scatters it can give back (``readable``) and their packed bytes, chunk by chunk (``read_back``)."""

    def __init__(self, plan: Plan, params: Mapping[str, torch.Tensor], eligible: Collection[str]):
        self.plan = plan
        self.readable = readable_scatters(plan, params, eligible)
        """Group -> the indices of its scatters that can be read back."""
        self.params = {s.dst: params[s.dst] for g in plan.groups for i in self.readable.get(g.name, ())
                       for s in (g.scatters[i],)}
        """The parameters read back (only those: the others may be re-bound later and are not kept alive here)."""
        self._unpackers: dict[str, GroupUnpacker] = {}

    def read_back(self, group: str, chunk: Chunk, dst: torch.Tensor) -> None:
        """The bytes ``chunk`` of ``group`` packs (every scatter of it readable), from the parameters, into
        ``dst`` (its ``chunk.nbytes``), on the current stream."""
        u = self._unpackers.get(group)
        if u is None:
            g = self.plan.group(group)
            u = self._unpackers[group] = GroupUnpacker(g, layout_group(g))
        u.read_back(self.params, dst, chunk, base=chunk.start)
