"""The trainer-side API that RL frameworks implement: :class:`WeightSource`.

A source describes the full (HF checkpoint format) tensors of the model and materialises, on this trainer
rank, the ones it holds. It has the same five methods as vLLM's ``WeightSource`` (``metadata``,
``__iter__``, ``held_names``, ``groups``, ``iter_groups``), with the same contract, so either kind can be
handed to shardsync (``sources.adapt``) and shardsync's to vLLM's backends (``integrations.vllm.vllm_source``)::

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
import operator
from abc import ABC, abstractmethod
from itertools import repeat
from typing import Any, Collection, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .errors import MetadataMismatch
from .plan.viewcache import SameTensors
from .plan.groups import weight_group
from .types import ParamMeta, dtype_name

__all__ = ["WeightSource", "ModuleSource", "LiveTensors", "SourceChanged", "check_tensor", "gather_groups"]

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


class SourceChanged(MetadataMismatch):
    """A tensor of a source's metadata is gone, or has another shape or dtype, at a sync after init (a parameter
    dropped, re-registered with another shape, ``p.data`` swapped for a tensor of another dtype, a key dropped from a
    dict source). The sync fails on this trainer rank before it gathers anything; the engines keep their last
    complete version. ``tensor``, ``rank``, ``expected`` and ``found`` say what changed."""

    def __init__(self, *, tensor: str, rank: int | None, expected: str, found: str, source: str = "ModuleSource"):
        self.tensor, self.rank, self.expected, self.found = tensor, rank, expected, found
        where = f"trainer rank {rank}" if rank is not None else "this trainer rank"
        super().__init__(f"{source}: tensor {tensor!r} on {where}: expected {expected} (its metadata at init), found "
                         f"{found}; a source's tensors may change in place or be swapped for ones of the same shape "
                         "and dtype between syncs, never go away or change shape or dtype")


def _meta_str(dtype: torch.dtype, shape: Sequence[int]) -> str:
    return f"{dtype_name(dtype)}{list(shape)}"


class _Batch:
    """One batch of names :class:`LiveTensors` resolves together, and what it served for them last pass."""

    __slots__ = ("names", "owners", "kinds", "attrs", "via", "slow", "seen", "dtypes", "served")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.owners: list[int] = []
        """Per name: the index of its owner module in a pass's module list."""
        self.kinds: list[str] = []
        """Per name: ``_parameters`` or ``_buffers``, where it was registered at construction."""
        self.attrs: list[str] = []
        self.via: list[bool] = []
        """Per name: read from ``state_dict()`` (a hook renames it, or no attribute of its path holds it)."""
        self.slow = False
        """A name of the batch is read from ``state_dict()`` (a hook renames it): never the mapped path."""
        self.seen: SameTensors | None = None
        """The objects found last pass (weak references), when the whole batch was served from them."""
        self.dtypes: list[torch.dtype] = []
        self.served: list[torch.Tensor] = []
        """What was handed out for them (a parameter's detached alias, a plain tensor itself)."""


class LiveTensors:
    """The tensors of a module (or of a ``{name: tensor}`` mapping), looked up afresh by name on every pass, so a
    source follows what the trainer holds NOW: ``p.data = x``, ``module.weight = nn.Parameter(x)`` (CPU offloading,
    some optimizers), a submodule replaced or a mapping's key reassigned is served as it is now, never stale; a name
    gone, or a tensor of another shape or dtype than ``expect``, is a :class:`SourceChanged` naming it::

        live = LiveTensors(model, [names_of_group_0, ...], expect={n: (dtype, shape)}, rank=0)
        for names, tensors in zip(live.batches, live.current()): ...   # checked; raises SourceChanged

    Cost per pass, at C speed (maps over lists): the module tree is walked by the paths recorded at construction (one
    ``_modules`` lookup per module), each name looked up in its owner's ``_parameters``/``_buffers``, and each batch's
    objects compared with last pass's (``plan.viewcache.SameTensors``: the same objects at the same addresses, strides
    and sizes, and the same dtypes). Unchanged, the batch gets the SAME tensors as last pass (so the producer's
    per-batch identity check, ``engine/producer/same_batches.py``, holds for it); changed, new ones (a parameter's detached
    alias, a plain tensor itself), each checked against ``expect``, so the producer checks that batch in full. Between
    passes it keeps the aliases it served (the parameters' own storage, no copy): a swapped-out tensor's storage is let
    go at the next pass. Names a state-dict hook renames (no attribute of that path holds the tensor) are read from one
    ``state_dict(keep_vars=True)`` per pass."""

    def __init__(self, module: nn.Module | None, batches: Sequence[Sequence[str]],
                 expect: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], *, rank: int | None = None,
                 what: str = "ModuleSource"):
        self.module, self.expect, self.rank, self.what = module, dict(expect), rank, what
        self.batches = [_Batch(list(b)) for b in batches]
        self.dtensors = False
        """A DTensor was seen (its ``full_tensor()`` materialises it, per group)."""
        self._levels: list[tuple[list[int], list[str]]] = []   # per depth: (parents' indices, child names)
        self._paths: list[str] = [""]                          # module index -> its path (for errors)
        self._sd: Mapping[str, torch.Tensor] | None = None      # this pass's state_dict(keep_vars=True), if asked
        if module is None:
            return
        mods: list[nn.Module] = [module]
        index: dict[str, int] = {"": 0}
        by_depth: dict[int, list[tuple[str, nn.Module]]] = {}
        for path, m in module.named_modules(remove_duplicate=False):
            if path:
                by_depth.setdefault(path.count("."), []).append((path, m))
        for d in sorted(by_depth):  # parents first: one level of the tree per map at each pass
            pidx, names = [], []
            for path, m in by_depth[d]:
                parent, _, child = path.rpartition(".")
                if parent not in index or path in index:
                    continue
                pidx.append(index[parent])
                names.append(child)
                index[path] = len(mods)
                mods.append(m)
                self._paths.append(path)
            self._levels.append((pidx, names))
        state = module.state_dict(keep_vars=True)
        for b in self.batches:
            for n in b.names:
                path, _, attr = n.rpartition(".")
                i = index.get(path)
                t = state.get(n)
                kind = None if i is None or t is None else "_parameters" if mods[i]._parameters.get(attr) is t else \
                    "_buffers" if mods[i]._buffers.get(attr) is t else None
                b.owners.append(0 if i is None else i)
                b.kinds.append(kind or "_parameters")
                b.attrs.append(attr)
                b.via.append(kind is None)
            b.slow = any(b.via)

    def current(self, state: Mapping[str, torch.Tensor] | None = None) -> list[list[torch.Tensor]]:
        """Every batch's tensors as they are now (from ``state`` when there is no module), checked against
        ``expect``. Raises :class:`SourceChanged` for the first name gone or changed."""
        mods: list[Any] = []
        sd: Mapping[str, torch.Tensor] | None = None
        if self.module is None:
            assert state is not None, "a LiveTensors without a module reads a mapping"
        else:
            mods.append(self.module)
            for pidx, names in self._levels:  # the module tree as it is now
                try:
                    mods.extend(map(dict.get, map(_MODULES, map(mods.__getitem__, pidx)), names))
                except (AttributeError, TypeError):  # a module gone (None) above others: look them up one by one
                    mods.extend(_child(mods[p], c) for p, c in zip(pidx, names))
        out = []
        self._sd = None
        for b in self.batches:
            objs: list[Any] | None = None
            if self.module is None:
                objs = list(map(state.get, b.names))  # type: ignore[union-attr]
            elif not b.slow:
                try:
                    objs = list(map(dict.get, map(getattr, map(mods.__getitem__, b.owners), b.kinds), b.attrs))
                except (AttributeError, TypeError):  # an owner gone: say which below
                    objs = None
            if objs is None or any(map(operator.is_, objs, repeat(None))):
                objs = [self._find(b, i, mods, state) for i in range(len(b.names))]  # raises naming what is gone
            try:
                hit = b.seen is not None and b.seen.matches(objs) and list(map(_DTYPE, objs)) == b.dtypes
            except (AttributeError, TypeError):  # not a tensor
                hit = False
            if hit:
                out.append(b.served)  # unchanged since last pass: the same tensors as then
                continue
            if not all(map(isinstance, objs, repeat(torch.Tensor))):
                objs = [self._find(b, i, mods, state) for i in range(len(b.names))]
            out.append(self._serve(b, objs))
        self._sd = None
        return out

    def _find(self, b: _Batch, i: int, mods: list[Any], state: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        """Name ``i`` of ``b`` as it is now, wherever it is registered; SourceChanged when it is gone."""
        n = b.names[i]
        if self.module is None:
            t, gone = state.get(n), "no key of that name in the mapping any more"  # type: ignore[union-attr]
        elif b.via[i]:
            if self._sd is None:
                self._sd = self.module.state_dict(keep_vars=True)
            t, gone = self._sd.get(n), "no entry of that name in the module's state_dict any more"
        else:
            m, path, attr = mods[b.owners[i]], self._paths[b.owners[i]], b.attrs[i]
            t = None if m is None else _attr(m, attr)
            gone = (f"no parameter or buffer {attr!r} of module {path!r} any more" if m is not None else
                    f"nothing: its module {path!r} is no longer part of the model")
        if not isinstance(t, torch.Tensor):
            dtype, shape = self.expect[n]
            raise SourceChanged(tensor=n, rank=self.rank, expected=_meta_str(dtype, shape), found=gone,
                                source=self.what)
        return t

    def _serve(self, b: _Batch, objs: list[torch.Tensor]) -> list[torch.Tensor]:
        """A batch with a tensor new or changed since last pass: each checked, and what is served for them now (an
        unchanged member keeps last pass's alias)."""
        served: list[torch.Tensor] = []
        prevs = b.served if len(b.served) == len(b.names) else [None] * len(b.names)
        dt_seen = False
        for n, t, prev in zip(b.names, objs, prevs):
            dtype, shape = self.expect[n]
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise SourceChanged(tensor=n, rank=self.rank, expected=_meta_str(dtype, shape),
                                    found=_meta_str(t.dtype, t.shape), source=self.what)
            if callable(getattr(t, "full_tensor", None)):  # a DTensor: materialised per group, never cached
                dt_seen = True
                served.append(t.detach())
            elif isinstance(t, nn.Parameter) or t.requires_grad:
                same = prev is not None and not callable(getattr(prev, "full_tensor", None)) and \
                    prev.data_ptr() == t.data_ptr() and prev.stride() == t.stride() and prev.shape == t.shape and \
                    prev.dtype == t.dtype
                served.append(prev if same else t.detach())
            else:
                served.append(t)
        self.dtensors = self.dtensors or dt_seen
        b.served, b.dtypes = served, list(map(_DTYPE, objs))
        b.seen = None if dt_seen else SameTensors(objs)
        return served


_MODULES = operator.attrgetter("_modules")
_DTYPE = operator.attrgetter("dtype")


def _child(parent: Any, name: str) -> Any:
    return None if parent is None else parent._modules.get(name)


def _attr(m: nn.Module, attr: str) -> torch.Tensor | None:
    """The tensor registered (or set) as ``m.<attr>`` now, or None."""
    t = m._parameters.get(attr)
    if t is None:
        t = m._buffers.get(attr)
        if t is None:
            t = m.__dict__.get(attr)
            if not isinstance(t, torch.Tensor):
                return None
    return t


class ModuleSource(WeightSource):
    """A source over an ``nn.Module`` (its ``state_dict`` names) or a plain ``{name: tensor}`` mapping of full local
    tensors; ``held`` restricts what this rank holds (a PP stage); ``rank`` is only for error messages (default: the
    ``torch.distributed`` rank, if initialised). DTensor values are materialised with ``full_tensor()`` (a
    collective, in lockstep); prefer ``sources.FSDPSource`` for one gather per group.

    The source follows the module (or the mapping, which it keeps a reference to, not a copy): every pass looks each
    tensor up by name again (:class:`LiveTensors`), so a parameter swapped between syncs (``p.data = x``,
    ``module.weight = nn.Parameter(x)``, a dict's value replaced) is served as it is now; one updated in place is the
    same object as last sync (the producer skips that batch's checks). A tensor that is gone, or has another shape or
    dtype than at construction, fails the pass with :class:`SourceChanged` before its first batch is yielded."""

    def __init__(self, module_or_state: nn.Module | Mapping[str, torch.Tensor], *,
                 held: Collection[str] | None = None, rank: int | None = None):
        if isinstance(module_or_state, nn.Module):
            self.module: nn.Module | None = module_or_state
            state: Mapping[str, torch.Tensor] = self.module.state_dict(keep_vars=True)
            self._state: Mapping[str, torch.Tensor] | None = None
        else:
            self.module, state = None, module_or_state
            self._state = module_or_state
            """The mapping itself (looked up each pass: a key replaced or dropped is seen)."""
        self._held = None if held is None else frozenset(held)
        unknown = set() if self._held is None else self._held - state.keys()
        if unknown:
            raise MetadataMismatch(f"ModuleSource: held names {sorted(unknown)[:5]} are not in the state dict")
        self.rank = rank if rank is not None else _dist_rank()
        # metadata, groups and which names to resolve are fixed at construction: computed once, not per sync
        self._metas = [ParamMeta(name=n, dtype=dtype_name(t.dtype), shape=tuple(t.shape)) for n, t in state.items()]
        self._groups = super().groups()
        self._live = LiveTensors(self.module, [[n for n in g if self._held is None or n in self._held]
                                               for g in self._groups],
                                 {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}, rank=self.rank)
        self._live.current(self._state)   # the first pass's aliases; DTensors noticed

    def metadata(self) -> list[ParamMeta]:
        return list(self._metas)

    def held_names(self) -> Collection[str] | None:
        return self._held

    def groups(self) -> list[list[str]]:
        return [list(g) for g in self._groups]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors)

    def iter_groups(self) -> Iterator[Batch]:
        """One batch per group, from the tensors as they are at the start of the pass (every held one looked up and
        checked before the first batch: a source that changed fails before anything is gathered or sent)."""
        batches = self._live.current(self._state)
        if self._held is None and not self._live.dtensors:  # the common case at C speed: the batches as they are
            for group, tensors in zip(self._groups, batches):
                yield list(group), list(tensors)
            return
        for group, b, tensors in zip(self._groups, self._live.batches, batches):
            got = dict(zip(b.names, tensors))
            yield list(group), [_full(got[n]) if n in got else None for n in group]


def _dist_rank() -> int | None:
    import torch.distributed as dist  # noqa: PLC0415 - only asked once, at construction

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
