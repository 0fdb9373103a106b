"""Check a plan received from a peer against the trainer's metadata before anything acts on it.

A plan arrives over the wire from a consumer; the producer replays its op chains on the trainer's
tensors and sizes ring buffers from it. So before a plan is accepted: every op must be one the recorder
can produce (no ``getattr(torch, name)`` on an arbitrary name), every argument must decode, every
chain must replay on a meta tensor of the source's shape to exactly the recorded shape and dtype, every
strided view must lie inside its source, and sizes are bounded by the model::

    check_plan(plan, metadata)      # raises PlanError naming the consumer, group and tensor
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import PlanError
from ..types import FALLBACK_PREFIX, ParamMeta, Plan, Scatter, dtype_of
from . import opcodec
from .pack import replay
from .record import VIEW_OPS

__all__ = ["check_plan", "MAX_EXPANSION"]

MAX_EXPANSION = 64
"""A scatter may carry at most this many times its source's elements (``expand`` replicates)."""


def check_plan(plan: Plan, metadata: Sequence[ParamMeta]) -> None:
    metas = {m.name: m for m in metadata}
    fallback = {f.src for f in plan.fallback}
    for g in plan.groups:
        for i, s in enumerate(g.scatters):
            where = f"consumer {plan.consumer!r}: group {g.name!r}, scatter {i} ({s.src!r} -> {s.dst!r})"
            m = metas.get(s.src)
            if m is None:
                raise PlanError(f"{where}: source is not a trainer tensor")
            _check_scatter(s, m, where, fallback)
        for f in g.fills:
            if f.dst.startswith(FALLBACK_PREFIX) or not isinstance(f.value, (int, float, bool)):
                raise PlanError(f"consumer {plan.consumer!r}: group {g.name!r}: bad fill of {f.dst!r}")
    for f in plan.fallback:
        if f.src not in metas:
            raise PlanError(f"consumer {plan.consumer!r}: fallback source {f.src!r} is not a trainer tensor")


def _check_scatter(s: Scatter, m: ParamMeta, where: str, fallback: set[str]) -> None:
    for op in s.ops:
        if op.name not in VIEW_OPS:
            raise PlanError(f"{where}: op {op.name!r} is not one the recorder produces")
        try:
            [opcodec.decode(a) for a in op.args]
            [opcodec.decode(v) for v in op.kwargs.values()]
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise PlanError(f"{where}: op {op.name!r} has an argument that does not decode: {e}") from None
    try:
        dtype_of(s.src_dtype), dtype_of(s.dst_dtype)
    except Exception:
        raise PlanError(f"{where}: unknown dtype {s.src_dtype!r} / {s.dst_dtype!r}") from None
    if any(not isinstance(d, int) or d < 0 for d in s.shape):
        raise PlanError(f"{where}: bad shape {s.shape}")
    numel = s.numel
    if numel > max(m.numel, 1) * MAX_EXPANSION:
        raise PlanError(f"{where}: {numel} elements from a source of {m.numel}: more than {MAX_EXPANSION}x")
    if s.dst.startswith(FALLBACK_PREFIX):
        if s.src not in fallback or s.ops or s.shape != tuple(m.shape) or s.dst != FALLBACK_PREFIX + s.src:
            raise PlanError(f"{where}: a fallback scatter must carry its whole, declared source")
    if s.view is not None:
        v = s.view
        if len(v.shape) != len(v.stride) or v.offset < 0 or any(x < 0 for x in v.stride):
            raise PlanError(f"{where}: malformed strided view")
        last = v.offset + sum((d - 1) * st for d, st in zip(v.shape, v.stride)) if all(v.shape) else v.offset - 1
        if last >= m.numel:
            raise PlanError(f"{where}: strided view reaches element {last} of a source of {m.numel}")
    full = torch.empty(m.shape, dtype=dtype_of(m.dtype), device="meta")
    try:
        out = replay(s, full)
    except Exception as e:
        raise PlanError(f"{where}: op chain does not replay on the source's shape {tuple(m.shape)}: "
                        f"{type(e).__name__}: {e}") from None
    if tuple(out.shape) != tuple(s.shape):
        raise PlanError(f"{where}: op chain gives shape {tuple(out.shape)}, the plan says {tuple(s.shape)}")
    if out.dtype != dtype_of(s.src_dtype):
        raise PlanError(f"{where}: op chain gives dtype {out.dtype}, the plan says {s.src_dtype}")
