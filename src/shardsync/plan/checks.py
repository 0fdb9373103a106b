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
from .pack import apply_op, replay
from .opcodec import VIEW_OPS

__all__ = ["check_plan", "max_scatters", "MAX_EXPANSION", "MAX_SCATTERS_PER_TENSOR", "SCATTER_SLACK"]

MAX_EXPANSION = 64
"""A scatter may carry at most this many times its source's elements (``expand`` replicates)."""
MAX_SCATTERS_PER_TENSOR = 16
"""Scatters one plan may have per trainer tensor (beside ``SCATTER_SLACK``): packing and checks cost per scatter."""
SCATTER_SLACK = 4096


def max_scatters(n_tensors: int) -> int:
    """The most scatters one plan may have: ``MAX_SCATTERS_PER_TENSOR`` per trainer tensor, plus ``SCATTER_SLACK``
    (a loader's plan has about one per tensor it reads; a TP slice, a fused split or an expert a few)."""
    return MAX_SCATTERS_PER_TENSOR * n_tensors + SCATTER_SLACK


def check_plan(plan: Plan, metadata: Sequence[ParamMeta]) -> None:
    n = sum(len(g.scatters) for g in plan.groups)  # counted first: the checks below cost per scatter
    if n > max_scatters(len(metadata)):
        raise PlanError(f"consumer {plan.consumer!r}: plan has {n} scatters, more than {max_scatters(len(metadata))} "
                        f"({MAX_SCATTERS_PER_TENSOR} per trainer tensor, {len(metadata)} tensors, + {SCATTER_SLACK}): "
                        "packing and checking cost per scatter")
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
    model_bytes = sum(m.nbytes for m in metadata)  # bounds the producer's ring, sized from the plans
    payload = sum(s.nbytes for g in plan.groups for s in g.scatters)
    if payload > MAX_EXPANSION * max(model_bytes, 1):
        raise PlanError(f"consumer {plan.consumer!r}: plan carries {payload} bytes, more than {MAX_EXPANSION}x the "
                        f"model's {model_bytes}")


def _check_scatter(s: Scatter, m: ParamMeta, where: str, fallback: set[str]) -> None:
    for op in s.ops:
        if op.name not in VIEW_OPS:
            raise PlanError(f"{where}: op {op.name!r} is not one the recorder produces")
        try:
            [opcodec.decode(a) for a in op.args]
            [opcodec.decode(v) for v in op.kwargs.values()]
        except Exception as e:  # any malformed argument (overflowing ints, deep nesting, unknown names)
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
        if s.view is not None:
            out = replay(s, full)
        else:
            out = _replay_checked(s, full, m, where)
    except PlanError:
        raise
    except Exception as e:
        raise PlanError(f"{where}: op chain does not replay on the source's shape {tuple(m.shape)}: "
                        f"{type(e).__name__}: {e}") from None
    if tuple(out.shape) != tuple(s.shape):
        raise PlanError(f"{where}: op chain gives shape {tuple(out.shape)}, the plan says {tuple(s.shape)}")
    if out.dtype != dtype_of(s.src_dtype):
        raise PlanError(f"{where}: op chain gives dtype {out.dtype}, the plan says {s.src_dtype}")


def _replay_checked(s: Scatter, full: torch.Tensor, m: ParamMeta, where: str) -> torch.Tensor:
    """The op chain on a meta tensor, op by op: every intermediate bounded in size, every constant index
    inside the dimension it indexes (meta kernels never read index values)."""
    t = full
    bound = max(m.numel, 1) * MAX_EXPANSION
    for op in s.ops:
        args = tuple(_on_meta(opcodec.decode(a)) for a in op.args)
        kwargs = {k: _on_meta(opcodec.decode(v)) for k, v in op.kwargs.items()}
        if op.name == "index_select":
            dim = int(args[0] if args else kwargs.get("dim", 0))
            _check_index(op.args[1] if len(op.args) > 1 else op.kwargs.get("index"), t.shape[dim], where)
        elif op.name == "__getitem__" and args:
            _check_getitem(op.args[0], t.shape, where)
        t = apply_op(t, op, args, kwargs)
        if t.numel() > bound:
            raise PlanError(f"{where}: op {op.name!r} gives {t.numel()} elements from a source of {m.numel}")
    return t


def _on_meta(x):
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, tuple):
        return tuple(_on_meta(i) for i in x)
    return x


def _index_values(enc) -> list[int] | None:
    """Integer index values of an encoded constant (tensor or list); None for anything else."""
    if isinstance(enc, dict) and "X" in enc:
        name, _, values = enc["X"]
        return None if name == "bool" else [int(v) for v in values]
    if isinstance(enc, dict) and "L" in enc:
        return [v for v in enc["L"] if isinstance(v, int)]
    return None


def _check_index(enc, size: int, where: str) -> None:
    values = _index_values(enc)
    if values and (min(values) < -size or max(values) >= size):
        raise PlanError(f"{where}: constant index {min(values)}..{max(values)} outside a dimension of {size}")


def _check_getitem(enc, shape: torch.Size, where: str) -> None:
    items = opcodec.decode(enc)
    items = items if isinstance(items, tuple) else (items,)
    encs = enc["T"] if isinstance(enc, dict) and "T" in enc else [enc]
    n_consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
    dim = 0
    for i, e in zip(items, encs):
        if i is Ellipsis:
            dim += len(shape) - n_consuming
            continue
        if i is None:
            continue
        if dim >= len(shape):
            raise PlanError(f"{where}: index has more dimensions than the tensor {tuple(shape)}")
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            if tuple(i.shape) != tuple(shape[dim:dim + i.dim()]):
                raise PlanError(f"{where}: bool mask {tuple(i.shape)} does not match dimensions {tuple(shape)}")
            dim += i.dim()
            continue
        if isinstance(i, int):
            if not -shape[dim] <= i < shape[dim]:
                raise PlanError(f"{where}: index {i} outside a dimension of {shape[dim]}")
        else:
            _check_index(e, shape[dim], where)
        dim += 1

