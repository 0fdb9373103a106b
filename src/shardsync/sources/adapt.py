"""One adapter between vLLM's ``WeightSource`` and shardsync's: ``adapt(src)`` returns a shardsync source for
either kind (shardsync's pass through unchanged), so ``Producer`` and the trainer backend take vLLM's own
sources (its ``ModuleSource`` over an FSDP2 module included) unchanged. The other direction, a shardsync
source handed to vLLM's backends, is ``integrations.vllm.vllm_source.as_vllm_source``.

    producer = Producer(adapt(vllm_module_source), cfg)

vLLM's source is duck-typed here (``metadata``/``iter_groups``/``held_names``; its ``ParamMeta.dtype`` is a
``torch.dtype``), so this module needs no vLLM import. Its groups (``layerwise_groups``: one per outermost
integer segment) are kept as they are: the lockstep order is the source's own, on every rank.
"""

from __future__ import annotations

from typing import Any, Collection, Iterator

import torch

from ..errors import MetadataMismatch
from ..source import Batch, SourceChanged, WeightSource, _dist_rank
from ..types import ParamMeta, dtype_name

__all__ = ["adapt", "ForeignSource"]


class ForeignSource(WeightSource):
    """A shardsync view of a source with vLLM's interface."""

    def __init__(self, inner: Any):
        for attr in ("metadata", "held_names", "iter_groups", "groups"):
            if not callable(getattr(inner, attr, None)):
                raise TypeError(f"{type(inner).__name__} is not a weight source: it has no {attr}() (expected "
                                "shardsync's or vLLM's WeightSource)")
        self.inner = inner
        self._metas: list[ParamMeta] | None = None
        self._expect: dict[str, tuple[str, tuple[int, ...]]] | None = None

    @property
    def stats(self) -> dict[str, Any]:
        """The wrapped source's own counters, if it keeps any (collectives, gathered bytes)."""
        return dict(getattr(self.inner, "stats", None) or {})

    def metadata(self) -> list[ParamMeta]:
        if self._metas is None:  # a Megatron-style export may be a collective: ask once
            self._metas = [ParamMeta(name=m.name, dtype=m.dtype if isinstance(m.dtype, str) else dtype_name(m.dtype),
                                     shape=tuple(int(x) for x in m.shape)) for m in self.inner.metadata()]
        return self._metas

    def held_names(self) -> Collection[str] | None:
        return self.inner.held_names()

    def groups(self) -> list[list[str]]:
        return [list(g) for g in self.inner.groups()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors)

    def iter_groups(self) -> Iterator[Batch]:
        """The wrapped source's batches, each tensor checked against the metadata (the wrapped source looks its
        tensors up itself each pass, e.g. vLLM's ``ModuleSource`` by ``named_parameters()``: one swapped for another
        shape or dtype since init is a :class:`~shardsync.source.SourceChanged` naming it, never served)."""
        if self._expect is None:
            self._expect = {m.name: (m.dtype, tuple(m.shape)) for m in self.metadata()}
        expect, rank = self._expect, _dist_rank()
        for names, tensors in self.inner.iter_groups():
            if len(names) != len(tensors):
                raise MetadataMismatch(f"weight source yielded {len(names)} names and {len(tensors)} tensors for "
                                       f"group {names[:1]}")
            for n, t in zip(names, tensors):
                if t is None:
                    continue
                dt, shape = expect.get(n, (None, None))
                if dt is None:
                    raise MetadataMismatch(f"weight source yielded {n!r} (rank {rank}), which its metadata at init "
                                           "does not list")
                if tuple(t.shape) != shape or dtype_name(t.dtype) != dt:
                    raise SourceChanged(tensor=n, rank=rank, expected=f"{dt}{list(shape)}",
                                        found=f"{dtype_name(t.dtype)}{list(t.shape)}", source=type(self.inner).__name__)
            yield list(names), list(tensors)


def adapt(source: Any) -> WeightSource:
    """A shardsync ``WeightSource`` for ``source`` (shardsync's own, or anything with vLLM's interface)."""
    if isinstance(source, WeightSource):
        return source
    inner = getattr(source, "shardsync_source", None)  # our own source wrapped for vLLM: unwrap, don't double-wrap
    if isinstance(inner, WeightSource):
        return inner
    return ForeignSource(source)
