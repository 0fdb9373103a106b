"""A WeightSource over a one-pass ``(name, full tensor)`` stream that every trainer rank sees alike.

Frameworks that gather for the rollout side (verl's checkpoint engine, SkyRL's weight extractors) hand every
trainer rank the same sequence of FULL tensors, one at a time (each an all-gather / PP broadcast the ranks run in
lockstep). shardsync wants to know which rank serves which tensor; here nothing is sharded any more, so ownership
is chosen: :func:`owners` splits the tensors over the trainer ranks, each to the least-loaded rank so far (by
bytes, in metadata order) — a pure function of the metadata, so every rank computes the same split and every
tensor is pulled from exactly one rank. A rank keeps only the tensors it owns and drops the others as soon as they
are yielded.

Memory: on the first update the producer needs the model's metadata before it can start, so that pass is
materialised — each rank keeps the full tensors it owns (about model_bytes / n_trainers) until the update
ends (``clear()``). From the second update on the metadata is known and the stream is consumed while the
producer serves: a rank then holds its owned tensors only until their group has been packed and released (at
most the producer's ``lookahead + 1`` groups), as with any shardsync source.

    src = StepSource(rank=1, n_trainers=2)
    src.materialise(weights)              # first update: learn metadata, keep owned tensors
    src.stream(weights)                   # later updates: consumed by Producer.sync via iter_groups()
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Iterator

import torch

from ..errors import MetadataMismatch
from ..source import Batch, WeightSource, check_tensor
from ..types import ParamMeta, dtype_name

__all__ = ["StepSource", "owners"]


def owners(metas: Iterable[ParamMeta], n_trainers: int) -> dict[str, int]:
    """Each tensor's serving rank: the least-loaded rank so far by bytes, in order (ties: the lowest rank)."""
    load = [0] * n_trainers
    out: dict[str, int] = {}
    for m in metas:
        r = min(range(n_trainers), key=lambda i: (load[i], i))
        out[m.name] = r
        load[r] += m.nbytes
    return out


class StepSource(WeightSource):
    def __init__(self, *, rank: int, n_trainers: int):
        self.rank, self.n_trainers = rank, n_trainers
        self.metas: list[ParamMeta] | None = None
        self._held: frozenset[str] = frozenset()
        self._pending: Iterator[tuple[str, Any]] | None = None

    # ---------------------------------------------------------------- feeding one update
    def materialise(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """First update: read the whole generator, learn the metadata, keep only the owned tensors."""
        metas: list[ParamMeta] = []
        kept: dict[str, torch.Tensor] = {}
        names: set[str] = set()
        load = [0] * self.n_trainers
        for name, t in weights:
            if not isinstance(t, torch.Tensor):
                raise MetadataMismatch(f"trainer rank {self.rank}: weight {name!r} is a {type(t).__name__}, "
                                       "not a tensor")
            if name in names:
                raise MetadataMismatch(f"trainer rank {self.rank}: weight {name!r} was yielded twice")
            meta = ParamMeta(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape))
            r = min(range(self.n_trainers), key=lambda i: (load[i], i))  # the same rule as owners()
            load[r] += meta.nbytes
            metas.append(meta)
            names.add(name)
            if r == self.rank:
                kept[name] = t
        self.metas = metas
        own = owners(metas, self.n_trainers)
        self._held = frozenset(n for n, r in own.items() if r == self.rank)
        self._pending = iter([(m.name, kept.pop(m.name, None)) for m in metas])

    def stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Later updates: the producer consumes ``weights`` while it serves (checked against the metadata)."""
        if self.metas is None:
            raise RuntimeError("StepSource.stream before the first materialise()")
        self._pending = iter(weights)

    def clear(self) -> None:
        """Drop what this update still references (``finalize``)."""
        self._pending = None

    # ---------------------------------------------------------------- WeightSource
    def metadata(self) -> list[ParamMeta]:
        if self.metas is None:
            raise RuntimeError("StepSource has no metadata before the first update")
        return list(self.metas)

    def held_names(self) -> Collection[str] | None:
        return self._held

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors)

    def iter_groups(self) -> Iterator[Batch]:
        """One batch per group of ``groups()``, in order, pulling the update's generator as far as each group
        needs (a group's names may arrive interleaved with another's); tensors this rank does not own are dropped
        on arrival, every tensor is checked against the metadata, and the generator is drained to its end (the
        ranks' gathers are collectives: every rank runs every one)."""
        it, self._pending = self._pending, None
        if it is None:
            raise RuntimeError(f"trainer rank {self.rank}: no weights were given for this update")
        by_name = {m.name: m for m in self.metadata()}
        seen: set[str] = set()
        kept: dict[str, torch.Tensor] = {}

        def pull() -> bool:
            try:
                name, t = next(it)
            except StopIteration:
                return False
            meta = by_name.get(name)
            if meta is None:
                raise MetadataMismatch(f"trainer rank {self.rank}: weight {name!r} is not in the metadata learnt on "
                                       f"the first update ({len(by_name)} tensors); the model's names must not change")
            if name in seen:
                raise MetadataMismatch(f"trainer rank {self.rank}: weight {name!r} was yielded twice in one update")
            seen.add(name)
            if t is not None:
                if not isinstance(t, torch.Tensor):
                    raise MetadataMismatch(f"trainer rank {self.rank}: weight {name!r} is a {type(t).__name__}")
                check_tensor(meta, t, rank=self.rank)
                if name in self._held:
                    kept[name] = t
            return True

        for group in self.groups():
            for n in group:
                while n not in seen:
                    if not pull():
                        raise MetadataMismatch(f"trainer rank {self.rank}: the weights generator ended before "
                                               f"{n!r} (group {group[0]!r}...)")
            yield list(group), [kept.pop(n, None) if n in self._held else None for n in group]
        while pull():  # the rest: groups this rank serves nothing of, still gathered in lockstep
            pass
        missing = [n for n in by_name if n not in seen]
        if missing:
            raise MetadataMismatch(f"trainer rank {self.rank}: the weights generator ended without {missing[:3]} "
                                   f"({len(missing)} tensors missing)")
