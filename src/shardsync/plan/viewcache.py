"""The packers' and unpackers' view caches (``plan/pack.py``): views of tensors that stay the same objects from one
call to the next are built once and replayed; :class:`SameTensors` says whether they are the same (also used by the
producer's per-batch checks, ``engine/producer/same_batches.py``)."""

from __future__ import annotations

import operator
import weakref
from itertools import repeat
from typing import Callable

import torch

from .graphs import Replay

__all__ = ["SameTensors", "Uncacheable"]


class SameTensors:
    """"The same tensors as last time", checked at C speed (a few maps over the list, ~1 µs a tensor): the same live
    objects (weak references: nothing is kept alive) at the same addresses with the same strides and element counts.
    ``None`` entries are allowed (a source's position left empty) and must stay ``None``. A ``.data`` swap or a
    re-allocation is noticed; only an in-place ``as_strided_``/``set_`` to another shape with the same address,
    strides and size would not be. Used by the view caches here and the producer's per-batch checks
    (``engine/producer/same_batches.py``)."""

    __slots__ = ("sig", "refs")

    def __init__(self, tensors: list) -> None:
        self.sig = self.signature(tensors)
        none = type(None)  # called, it gives None: the "reference" of an empty position
        self.refs = [none if t is None else weakref.ref(t) for t in tensors]

    @staticmethod
    def signature(tensors: list) -> tuple:
        T = torch.Tensor
        live = [t for t in tensors if t is not None] if any(map(operator.is_, tensors, repeat(None))) else tensors
        return (list(map(id, tensors)), list(map(T.data_ptr, live)), list(map(T.stride, live)),
                list(map(T.numel, live)))

    def matches(self, tensors: list) -> bool:
        return len(self.refs) == len(tensors) and self.signature(tensors) == self.sig and \
            all(map(operator.is_, map(operator.call, self.refs), tensors))


class _Stable:
    """Views of tensors that stay the same objects from one call to the next, built once and replayed (rule 4:
    nothing in the hot path re-derives what the plan knows). Tensors that are new every call (an FSDP
    all-gather's output) are only ever weakly referenced, so no gathered tensor outlives its call.

    "The same" is checked each call by :class:`SameTensors`."""

    __slots__ = ("seen", "views", "replay", "gen")

    def __init__(self) -> None:
        self.gen: int | None = None
        """The caller's generation the cached views were last found valid at (``get(gen=)``)."""
        self.seen: SameTensors | None = None
        """The tensors of the last call (None after a build that cannot be cached)."""
        self.views: object = None
        self.replay = Replay()
        """The cached views' program as a CUDA graph (``plan/graphs.py``); reset with the views."""

    def get(self, tensors: list[torch.Tensor], build: Callable[[], object],
            gen: int | None = None) -> tuple[object, Replay | None]:
        """(views, their ``Replay`` when they are the cached ones, else None). ``gen``: the caller vouches that
        ``tensors`` are the objects of the last call at which it passed the same ``gen`` (unchanged since): cached
        views found valid at that generation are returned without looking at the tensors."""
        if gen is not None and gen == self.gen and self.views is not None:
            return self.views, self.replay
        same = self.seen is not None and self.seen.matches(tensors)
        if same and self.views is not None:
            self.gen = gen
            return self.views, self.replay
        views = build()
        if isinstance(views, Uncacheable):
            self.seen = self.gen = None
            return views.views, None
        self.views = views if same else None  # cached from the second call on the same tensors
        self.gen = gen if same else None
        self.replay = Replay()
        if not same:
            self.seen = SameTensors(tensors)
        return views, None


class Uncacheable:
    """What a build returns when its views must be built again every call: some source was not a view of its
    tensor (an op chain with a copy, e.g. ``index_select``, replayed op by op: a cached copy would go stale)."""

    __slots__ = ("views",)

    def __init__(self, views: object):
        self.views = views


class _Views:
    """One ``_Stable`` per (chunk, buffer address and size, base): a ring or a receive pool is a few fixed buffers,
    so views of the buffer are keyed by its address (a slice of it is a new tensor object every call). At most
    ``cap`` keys are kept (every chunk in each of a ring's slots, with room to spare)."""

    def __init__(self, cap: int = 64) -> None:
        self.by_key: dict[tuple, _Stable] = {}
        self.cap = cap

    def get(self, key: tuple, tensors: list[torch.Tensor], build: Callable[[], object],
            gen: int | None = None) -> tuple[object, Replay | None]:
        st = self.by_key.get(key)
        if st is None:
            if len(self.by_key) >= self.cap:
                self.by_key.clear()
            st = self.by_key[key] = _Stable()
        return st.get(tensors, build, gen)
