"""Check a recorded plan against the engine's real loaders on random data.

A loader can write a parameter in ways no recording sees (a NumPy view, a Python-side cache, a
kernel that bypasses torch's dispatch). Before any sync, run the real loaders on random full tensors
into scratch parameters, run the plan on the same tensors into the same (re-sentinelled) parameters,
and compare bytes::

    validate_group(load_weights=scratch_model.load_weights, params=scratch_params,
                   group=plan.group("model.layers.0"), metas=metas_of_layer0, rank=0)

A difference raises PlanError naming the tensor.
"""

from __future__ import annotations

import zlib
from typing import Callable, Iterable, Mapping, Sequence

import torch

from ..errors import PlanError
from .pack import GroupPacker, GroupUnpacker, layout_group
from ..types import FALLBACK_PREFIX, GroupPlan, ParamMeta, dtype_of

__all__ = ["random_full", "validate_group", "load_fallbacks", "SENTINEL", "raw_bytes", "same_bytes", "mismatched", "fill_sentinel"]

SENTINEL = 0xA5


def random_full(meta: ParamMeta, seed: int) -> torch.Tensor:
    """A deterministic random full tensor for ``meta`` (never all zeros)."""
    g = torch.Generator().manual_seed((seed ^ zlib.crc32(meta.name.encode())) & 0x7FFFFFFF)
    dt = dtype_of(meta.dtype)
    if dt.is_floating_point:
        return torch.randn(meta.shape, generator=g, dtype=torch.float32).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, meta.shape, generator=g).bool()
    return torch.randint(-100, 100, meta.shape, generator=g).to(dt)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (contiguous copy if needed)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality: same dtype, same shape, same bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bytes(a), raw_bytes(b))


def mismatched(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of ``a`` whose tensor is not bit-exactly ``b``'s (both must hold the same names)."""
    if a.keys() != b.keys():
        raise ValueError(f"cannot compare: names differ {sorted(a.keys() ^ b.keys())[:5]}")
    return [k for k in a if not same_bytes(a[k], b[k])]


def fill_sentinel(t: torch.Tensor) -> None:
    """Fill with a byte pattern no loader writes by chance (by value for non-contiguous tensors)."""
    if t.is_contiguous():
        t.data.reshape(-1).view(torch.uint8).fill_(SENTINEL)
    else:
        t.data.fill_(-3.25 if t.dtype.is_floating_point else -3)


def load_fallbacks(load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
                   scratch: Mapping[str, torch.Tensor]) -> None:
    """Hand each fallback tensor (received whole into its scratch buffer) to the engine's real loader."""
    if scratch:
        load_weights([(n.removeprefix(FALLBACK_PREFIX), t) for n, t in scratch.items()])


def validate_group(*, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
                   params: Mapping[str, torch.Tensor], group: GroupPlan, metas: Sequence[ParamMeta],
                   rank: int | None = None, seed: int = 1234) -> int:
    """Compare the loaders' result with the plan's on random data; returns the tensors compared.

    ``params`` are scratch tensors the loaders write (the ones of this group's modules); every byte
    of them must come out equal, including bytes neither writes (sentinel)."""
    full = {m.name: random_full(m, seed) for m in metas}
    with torch.no_grad():
        for t in params.values():
            fill_sentinel(t)
        load_weights(list(full.items()))
        expected = {n: raw_bytes(t).clone() for n, t in params.items()}
        for t in params.values():
            fill_sentinel(t)
        layout = layout_group(group)
        buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        GroupPacker(group, layout).pack({n: t.contiguous() for n, t in full.items()}, buf)
        scratch = {s.dst: torch.empty(s.shape, dtype=dtype_of(s.dst_dtype)) for s in group.scatters
                   if s.dst.startswith(FALLBACK_PREFIX)}
        GroupUnpacker(group, layout).unpack(buf, {**params, **scratch})
        load_fallbacks(load_weights, scratch)
    where = f" on consumer rank {rank}" if rank is not None else ""
    for n, t in params.items():
        got = raw_bytes(t)
        if not torch.equal(got, expected[n]):
            writers = sorted({s.src for s in group.scatters if s.dst == n}) or ["<no recorded copy>"]
            diff = int((got != expected[n]).sum())
            raise PlanError(f"the recorded plan disagrees with the engine's loaders{where} on tensor {n!r} "
                            f"(filled from {writers[:4]}): {diff} of {got.numel()} bytes differ on random data — "
                            "the loader writes it in a way the recording did not see")
    return len(params)
