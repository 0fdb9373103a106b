"""The fallback path's discovery: which parameters a loader writes when it cannot be recorded.

A loader that computes values (``A = -exp(A_log)``, ``w * 2``) is refused by the recorder; its checkpoint
tensor then travels whole and the engine's real loader runs at sync time. Which parameters that loader
writes is found here, by running it on a plain meta tensor and watching every write that lands in a
parameter's storage (values are never computed)::

    fb = find_fallback(meta, model.load_weights, resolve, storages, reason, rank)   # Fallback(src, dests, reason)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import PlanError, UnsupportedLoaderOp
from ..types import Fallback, ParamMeta, dtype_of

__all__ = ["find_fallback", "param_written"]


def param_written(func, args: tuple, storages: set[int]) -> torch.Tensor | None:
    """The argument a dispatched op writes into, if it lies in one of the parameters' ``storages``."""
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write and i < len(args):
            t = args[i]
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage()._cdata in storages:
                return t
    return None


class _WriteCollector(TorchDispatchMode):
    """Which parameters a loader writes when given a plain meta tensor (values never computed)."""

    def __init__(self, resolve: Callable, storages: set[int]):
        super().__init__()
        self.resolve, self.storages, self.written = resolve, storages, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = param_written(func, args, self.storages)
        if t is None:
            return func(*args, **(kwargs or {}))
        hit = self.resolve(t)
        if hit is not None:
            self.written.add(hit[0])
        return t


def find_fallback(meta: ParamMeta, load_weights: Callable, resolve: Callable, storages: set[int],
                  reason: str, rank: int | None) -> Fallback:
    """The Fallback for ``meta``: the parameters its loader writes, found by a dry run on a plain meta tensor."""
    collector = _WriteCollector(resolve, storages)
    full = torch.empty(meta.shape, dtype=dtype_of(meta.dtype), device="meta")
    try:
        with collector:
            load_weights([(meta.name, full)])
    except Exception as e:  # e.g. the loader reads values (.item(), bool(t.any())): no meta dry run possible
        raise UnsupportedLoaderOp(tensor=meta.name, op="fallback dry run", chain="", rank=rank,
                                  detail=f"{reason}; and on a plain meta tensor the loader fails: "
                                         f"{type(e).__name__}: {e}") from None
    if not collector.written:
        raise PlanError(f"checkpoint tensor {meta.name!r} cannot be recorded ({reason}) and its loader writes no "
                        "parameter on a meta tensor either: no fallback is possible")
    return Fallback(src=meta.name, dests=tuple(sorted(collector.written)), reason=reason)
