"""Split weight groups larger than a memory budget into parts: the sync's transient memory bounded by a setting.

A weight group is the unit of a ring slot on the trainer and of a receive slot on the engine, so the largest group
sets both (``engine/schedule.py`` rules 4 and 9): a Qwen3-30B-A3B layer is 1.3 GB. :func:`split_groups` cuts every
group whose payload is above ``part_bytes`` into consecutive parts of its recorded writes, named ``<group>#<k>``,
each a group of its own from then on (packed, announced, pulled, applied and released alone). Pure.

Where it may cut: never between two writes whose destination regions overlap (a fill and the slice copied over it,
a fallback loader and any write to the parameters it fills), since parts are applied in any order; every such run
stays in one part (a part may then exceed ``part_bytes``, as does one write larger than it). The engine side
processes a module once every part writing it has been applied (``integrations/vllm/layerwise.LayerApplier``)::

    plan = split_to_budget(plan, metas, budget_bytes=None)   # None: min(10 % of the model, 1 GiB)
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from ..errors import PlanError
from ..types import FALLBACK_PREFIX, Fill, GroupPlan, ParamMeta, Plan, Scatter, itemsize
from .groups import PART

__all__ = ["split_to_budget", "split_groups", "split_group", "part_bytes_for", "budget_for", "DEFAULT_BUDGET_CAP"]

DEFAULT_BUDGET_CAP = 1 << 30
"""The default budget is the smaller of a tenth of the model's bytes and this."""


def budget_for(metas: Sequence[ParamMeta], budget_bytes: int | None) -> int:
    """The sync memory budget (``GroupSettings.sync_memory_bytes``): given, or the smaller of 10 % of the model's
    checkpoint bytes and 1 GiB; 0 means no budget."""
    if budget_bytes is not None:
        if budget_bytes < 0:
            raise ValueError(f"sync_memory_bytes={budget_bytes}: expected >= 0 (0: groups are never split)")
        return int(budget_bytes)
    return min(sum(m.nbytes for m in metas) // 10, DEFAULT_BUDGET_CAP)


def part_bytes_for(metas: Sequence[ParamMeta], budget_bytes: int | None) -> int:
    """Most payload bytes of one part: half the budget (two ring slots and two receive slots hold one part each
    while the next is filled). 0: no split."""
    return budget_for(metas, budget_bytes) // 2


def _extent(offset: int, shape: tuple[int, ...], stride: tuple[int, ...], dtype: str) -> tuple[int, int]:
    """[lo, hi) bytes of a strided region (a bounding interval: conservative for overlap)."""
    if any(s == 0 for s in shape):
        return offset, offset
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride))
    return offset, offset + span * itemsize(dtype)


class _Write(msgspec.Struct, frozen=True):
    dst: str
    lo: int
    hi: int
    nbytes: int
    scatter: Scatter | None
    fill: Fill | None


def _writes(g: GroupPlan) -> list[_Write]:
    """The group's writes in recorded order: the fills at position i come right before scatter i (trailing ones
    after the last scatter)."""
    fills: dict[int, list[Fill]] = {}
    for f in g.fills:
        fills.setdefault(f.pos, []).append(f)
    out: list[_Write] = []
    for i in range(len(g.scatters) + 1):
        for f in fills.get(i, ()):
            out.append(_Write(f.dst, *_extent(f.dst_byte_offset, f.shape, f.dst_stride, f.dst_dtype), 0, None, f))
        if i < len(g.scatters):
            s = g.scatters[i]
            out.append(_Write(s.dst, *_extent(s.dst_byte_offset, s.shape, s.dst_stride, s.dst_dtype), s.nbytes, s,
                              None))
    return out


def _no_cut(writes: list[_Write], fallback_dests: dict[str, tuple[str, ...]]) -> list[bool]:
    """``no_cut[i]``: a cut just before write i would separate two overlapping writes."""
    per_dst: dict[str, list[tuple[int, int, int]]] = {}
    for i, w in enumerate(writes):
        if w.dst.startswith(FALLBACK_PREFIX):  # the real loader writes whole parameters: it overlaps all their writes
            for d in fallback_dests.get(w.dst, ()):
                per_dst.setdefault(d, []).append((0, 1 << 62, i))
        per_dst.setdefault(w.dst, []).append((w.lo, w.hi, i))
    diff = [0] * (len(writes) + 1)

    def close(c_min: int, c_max: int) -> None:
        if c_max > c_min:  # cuts before c_min+1 .. c_max are forbidden
            diff[c_min + 1] += 1
            diff[c_max + 1] -= 1

    for spans in per_dst.values():
        spans.sort()
        c_hi, c_min, c_max = -1, 0, -1
        for lo, hi, i in spans:  # clusters of transitively overlapping regions stay in one part
            if lo < c_hi and hi > lo:
                c_hi, c_min, c_max = max(c_hi, hi), min(c_min, i), max(c_max, i)
                continue
            close(c_min, c_max)
            c_hi, c_min, c_max = hi, i, i
        close(c_min, c_max)
    out, run = [], 0
    for i in range(len(writes)):
        run += diff[i]
        out.append(run > 0)
    return out


def split_group(g: GroupPlan, part_bytes: int, fallback_dests: dict[str, tuple[str, ...]] | None = None
                ) -> list[GroupPlan]:
    """``g`` as parts of at most ``part_bytes`` payload where it can be cut (see the module's rule); ``[g]`` when it
    fits or cannot be cut."""
    if PART in g.name:
        raise PlanError(f"group {g.name!r}: a group name holding {PART!r} is a part already")
    if part_bytes <= 0 or g.nbytes <= part_bytes:
        return [g]
    writes = _writes(g)
    no_cut = _no_cut(writes, fallback_dests or {})
    cuts, acc = [0], 0
    for i, w in enumerate(writes):
        if acc and acc + w.nbytes > part_bytes and not no_cut[i] and w.scatter is not None:
            cuts.append(i)
            acc = 0
        acc += w.nbytes
    if len(cuts) == 1:
        return [g]
    cuts.append(len(writes))
    parts: list[GroupPlan] = []
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        scatters: list[Scatter] = []
        fills: list[Fill] = []
        for w in writes[a:b]:
            if w.scatter is not None:
                scatters.append(w.scatter)
            else:  # at its place among this part's own scatters
                fills.append(msgspec.structs.replace(w.fill, pos=len(scatters)))
        srcs = {s.src for s in scatters}
        parts.append(GroupPlan(name=f"{g.name}{PART}{k}", scatters=tuple(scatters),
                               nbytes=sum(s.nbytes for s in scatters),
                               sources=tuple(n for n in g.sources if n in srcs), fills=tuple(fills)))
    return parts


def split_groups(plan: Plan, part_bytes: int) -> Plan:
    """``plan`` with every group above ``part_bytes`` split into parts (``<group>#<k>``), resealed; the same plan
    when nothing is split."""
    if part_bytes <= 0:
        return plan
    fallback_dests = {f.scratch: tuple(f.dests) for f in plan.fallback}
    groups: list[GroupPlan] = []
    for g in plan.groups:
        groups.extend(split_group(g, part_bytes, fallback_dests))
    if len(groups) == len(plan.groups):
        return plan
    return msgspec.structs.replace(plan, groups=tuple(groups), digest="").sealed()


def split_to_budget(plan: Plan, metas: Sequence[ParamMeta], budget_bytes: int | None) -> Plan:
    """What a recorder registers: ``plan`` with its groups in parts of half the sync memory budget
    (``GroupSettings.sync_memory_bytes``; :func:`part_bytes_for`)."""
    return split_groups(plan, part_bytes_for(metas, budget_bytes))
