"""The trainer-side API that RL frameworks implement: :class:`WeightSource`.

A source describes the full (HF checkpoint format) tensors a trainer rank can produce, and
materialises them on demand. ``ModuleSource`` wraps a plain ``nn.Module`` or state dict::

    source = ModuleSource(model)            # or ModuleSource(state_dict)
    metas = source.metadata()               # names, dtypes, full shapes; no data moves
    for name, full in source: ...           # materialised full tensors
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Collection, Iterable, Iterator, Mapping

import torch
from torch import nn

from .errors import MetadataMismatch
from .types import ParamMeta, dtype_name

__all__ = ["WeightSource", "ModuleSource", "check_tensor"]


class WeightSource(ABC):
    """What one trainer rank offers. Implement ``metadata`` and ``__iter__``; override
    ``held_names`` under pipeline/expert parallelism and ``gather`` when a group can be
    materialised without iterating everything."""

    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        """Name, dtype and full shape of every tensor of the model (all ranks agree on it)."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, materialised full tensor) for every tensor this rank holds."""

    def held_names(self) -> Collection[str] | None:
        """The names THIS rank holds (PP stage, EP rank); None means all of them."""
        return None

    def gather(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Materialise the full tensors of ``names`` (one weight group). Default: one pass of ``__iter__``."""
        want = set(names)
        out = {n: t for n, t in self if n in want}
        missing = want - out.keys()
        if missing:
            raise MetadataMismatch(f"weight source did not produce {sorted(missing)[:5]} ({len(missing)} missing)")
        return out


def check_tensor(meta: ParamMeta, t: torch.Tensor, *, rank: int | None = None) -> None:
    """Raise MetadataMismatch unless ``t`` has the dtype and full shape the metadata promised."""
    if tuple(t.shape) != tuple(meta.shape) or dtype_name(t.dtype) != meta.dtype:
        where = f" on producer rank {rank}" if rank is not None else ""
        raise MetadataMismatch(
            f"tensor {meta.name!r}{where}: expected {meta.dtype}{list(meta.shape)}, "
            f"got {dtype_name(t.dtype)}{list(t.shape)}")


class ModuleSource(WeightSource):
    """A source over an ``nn.Module`` (its ``state_dict``) or a plain ``{name: tensor}`` mapping."""

    def __init__(self, module_or_state: nn.Module | Mapping[str, torch.Tensor], *,
                 held: Collection[str] | None = None):
        state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
        self._state: dict[str, torch.Tensor] = {k: v.detach() for k, v in state.items()}
        self._held = None if held is None else frozenset(held)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta.of(n, t) for n, t in self._state.items()]

    def held_names(self) -> Collection[str] | None:
        return self._held

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in self._state.items():
            if self._held is None or n in self._held:
                yield n, t

    def gather(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        out = {}
        for n in names:
            if n not in self._state or (self._held is not None and n not in self._held):
                raise MetadataMismatch(f"tensor {n!r} is not held by this ModuleSource")
            out[n] = self._state[n]
        return out
