"""The trainer-side API that RL frameworks implement: :class:`WeightSource`.

A source describes the full (HF checkpoint format) tensors of the model and materialises, on this trainer
rank, the ones it holds. It has the same five methods as vLLM's ``WeightSource`` (``metadata``,
``__iter__``, ``held_names``, ``groups``, ``iter_groups``), with the same contract, so either kind can be
handed to shardsync (``sources.adapt``) and shardsync's to vLLM's backends (``integrations.vllm.sources``)::

    source = ModuleSource(model)            # or ModuleSource(state_dict)
    metas = source.metadata()               # names, dtypes, full shapes of the WHOLE model; no data moves
    for names, tensors in source.iter_groups(): ...   # one batch per gather group, in metadata order

The lockstep contract (why ``iter_groups`` exists). Materialising a full tensor is usually a collective
(FSDP2 ``full_tensor()``, a TP all-gather), so every rank that holds part of a group must materialise that
group, in the same order, or its peers deadlock. ``groups()`` is this rank's gather groups in metadata
order (``plan.groups.weight_group`` partition: ``pre``, one per decoder layer, ``post``) restricted to the
groups holding at least one name this rank holds; ``iter_groups()`` yields exactly those, one
``(names, tensors)`` batch per group, a ``None`` tensor for a name of the group this rank does not hold.
The producer iterates every batch on every rank and keeps only what is routed to it
(``engine/schedule.py``, rule 2).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Collection, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .errors import MetadataMismatch
from .plan.groups import weight_group
from .types import ParamMeta, dtype_name

__all__ = ["WeightSource", "ModuleSource", "check_tensor", "gather_groups"]

Batch = tuple[list[str], list["torch.Tensor | None"]]


def gather_groups(names: Sequence[str]) -> list[list[str]]:
    """Partition names (metadata order) into gather groups, in order of first appearance: the
    ``weight_group`` of each name (``pre``, ``model.layers.N``, ..., ``post``). Asked every sync with the same
    names: the partition is computed once per distinct name list (the hot path matches no regex per tensor)."""
    return [list(g) for g in _partition(tuple(names))]


@functools.lru_cache(maxsize=8)
def _partition(names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(weight_group(n), []).append(n)
    return tuple(tuple(g) for g in out.values())


class WeightSource(ABC):
    """What one trainer rank offers. Implement ``metadata`` and ``__iter__``; override ``held_names`` under
    pipeline/expert parallelism and ``iter_groups`` when a whole group can be materialised in one step (one
    collective per group instead of one per tensor)."""

    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        """Name, dtype and full shape of every tensor of the WHOLE model (all ranks agree on it), in the order
        iteration yields them."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, "torch.Tensor | None"]]:
        """(name, materialised full tensor) for every name of ``groups()``, in metadata order; ``None`` for a
        name this rank does not hold. A fresh pass each time."""

    def held_names(self) -> Collection[str] | None:
        """The names THIS rank holds (PP stage, EP rank); None means all of them."""
        return None

    def groups(self) -> list[list[str]]:
        """This rank's gather groups in metadata order: those holding at least one held name."""
        groups = gather_groups([m.name for m in self.metadata()])
        held = self.held_names()
        if held is None:
            return groups
        held = set(held)
        return [g for g in groups if any(n in held for n in g)]

    def iter_groups(self) -> Iterator[Batch]:
        """One ``(names, tensors)`` batch per group of ``groups()``. The default batches ``__iter__`` and checks
        the order as it goes (a rank iterating out of order would deadlock its peers)."""
        it = iter(self)
        for group in self.groups():
            tensors: list[torch.Tensor | None] = []
            for expected in group:
                try:
                    name, t = next(it)
                except StopIteration:
                    raise MetadataMismatch(f"weight source stopped before {expected!r}; iteration must cover "
                                           "groups() in metadata order") from None
                if name != expected:
                    raise MetadataMismatch(f"weight source yielded {name!r} where {expected!r} was expected; "
                                           "iteration order must match metadata()")
                tensors.append(t)
            yield list(group), tensors

    def gather(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The full tensors of ``names`` by one pass over every group (not lockstep-safe for collective sources:
        single-process paths only — the driver-side packer, the loopback and the baseline)."""
        want = set(names)
        out: dict[str, torch.Tensor] = {}
        for ns, ts in self.iter_groups():
            for n, t in zip(ns, ts):
                if n in want and t is not None:
                    out[n] = t
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
    """A source over an ``nn.Module`` (its ``state_dict``) or a plain ``{name: tensor}`` mapping of full local
    tensors; ``held`` restricts what this rank holds (a PP stage). DTensor values are materialised with
    ``full_tensor()`` (a collective, in lockstep); prefer ``sources.FSDPSource`` for one gather per group."""

    def __init__(self, module_or_state: nn.Module | Mapping[str, torch.Tensor], *,
                 held: Collection[str] | None = None):
        state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
        self._state: dict[str, torch.Tensor] = {k: v.detach() for k, v in state.items()}
        self._held = None if held is None else frozenset(held)
        unknown = set() if self._held is None else self._held - self._state.keys()
        if unknown:
            raise MetadataMismatch(f"ModuleSource: held names {sorted(unknown)[:5]} are not in the state dict")
        # the tensors are fixed at construction (an optimizer updates them in place): what a sync asks of the source
        # — metadata, groups, which tensors to materialise — is computed once, not per tensor per sync
        self._metas = [ParamMeta(name=n, dtype=dtype_name(t.dtype), shape=tuple(t.shape)) for n, t in self._state.items()]
        self._groups = super().groups()
        self._dtensors = any(callable(getattr(t, "full_tensor", None)) for t in self._state.values())

    def metadata(self) -> list[ParamMeta]:
        return list(self._metas)

    def held_names(self) -> Collection[str] | None:
        return self._held

    def groups(self) -> list[list[str]]:
        return [list(g) for g in self._groups]

    def _get(self, n: str) -> torch.Tensor | None:
        if self._held is not None and n not in self._held:
            return None
        t = self._state[n]
        return _full(t) if self._dtensors else t

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for group in self._groups:
            for n in group:
                yield n, self._get(n)

    def iter_groups(self) -> Iterator[Batch]:
        if self._held is None and not self._dtensors:  # the common case at C speed: one map per batch
            state = self._state
            for group in self._groups:
                yield list(group), list(map(state.__getitem__, group))
            return
        get = self._get
        for group in self._groups:
            yield list(group), [get(n) for n in group]


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
