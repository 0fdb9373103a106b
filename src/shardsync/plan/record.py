"""Record a consumer's plan by a dry run of the engine's own weight loaders.

Each checkpoint tensor is handed to the loader as a :class:`RecordingTensor`: a storage-less tensor
subclass with the right shape, dtype and device. Every view-like op it undergoes is recorded (its
result shape computed by running the same op on a meta tensor) and every ``copy_`` of it into a
parameter becomes a :class:`~shardsync.types.Scatter`. Anything else (arithmetic, ``.to()``, value
reads, concatenation, broadcasting copies, …) raises :class:`~shardsync.errors.UnsupportedLoaderOp`
naming the tensor, the op and the chain so far — at initialisation, never mid-sync::

    plan = record_plan(metadata=source.metadata(), load_weights=model.load_weights,
                       params=dict(model.named_parameters()), consumer="tp0")
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping, Sequence

import msgspec
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import opcodec
from .fallback import find_fallback, param_written
from ..errors import PlanError, UnsupportedLoaderOp
from .groups import group_order, weight_group
from ..types import (DestParam, Fallback, Fill, GroupPlan, Op, ParamMeta, Plan, Scatter, StridedView, dtype_name,
                     dtype_of, metadata_digest)

__all__ = ["RecordingTensor", "Recorder", "record_plan", "DestinationResolver"]

# Ops that only select / reinterpret elements: replaying them on the real tensor gives the slice.
VIEW_OPS = opcodec.VIEW_OPS  # the allow-list lives with the wire vocabulary (producers check it too)
# Value-preserving ops that may copy: for the strided-view fold they are the identity.
IDENTITY_OPS = frozenset({"contiguous", "detach", "clone", "data"})
# Queries that read metadata only.
META_QUERIES = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "element_size",
    "storage_offset", "is_floating_point", "is_complex", "__len__", "shape", "dtype", "ndim",
    "nbytes", "itemsize", "layout", "requires_grad", "is_sparse", "is_quantized", "is_meta",
    "is_nested", "names", "__hash__",
})
DEVICE_QUERIES = frozenset({"device", "is_cuda", "is_cpu", "get_device", "is_xpu", "is_mps"})
REPR_OPS = frozenset({"__repr__", "__str__", "__format__"})


def _op_name(func: Callable) -> tuple[str, bool]:
    """(name, is_torch_function) of a ``__torch_function__`` func, properties resolved."""
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name), False
    return name, getattr(torch.Tensor, name, None) is not func and getattr(torch, name, None) is func


DestinationResolver = Callable[[torch.Tensor], "tuple[str, int, torch.Tensor] | None"]
"""Maps a real destination tensor to (parameter name, byte offset from its first byte, the parameter)."""


def storage_resolver(params: Mapping[str, torch.Tensor]) -> DestinationResolver:
    """Resolve destinations by storage identity (works for meta parameters too)."""
    by_storage: dict[int, tuple[str, torch.Tensor]] = {}
    for name, p in params.items():
        if p.numel() == 0:
            continue
        by_storage.setdefault(p.untyped_storage()._cdata, (name, p))

    def resolve(dest: torch.Tensor) -> tuple[str, int, torch.Tensor] | None:
        hit = by_storage.get(dest.untyped_storage()._cdata)
        if hit is None:
            return None
        name, p = hit
        return name, dest.storage_offset() * dest.element_size() - p.storage_offset() * p.element_size(), p

    return resolve


class Recorder:
    """Collects scatters from recording tensors; one per consumer dry run."""

    def __init__(self, resolve: DestinationResolver, *, rank: int | None = None, device: torch.device | str = "cpu"):
        self.resolve = resolve
        self.rank = rank
        self.device = torch.device(device)
        self.scatters: list[Scatter] = []
        self.fills: list[tuple[int, Fill]] = []
        """(index into ``scatters`` at the time, fill) in recorded order."""
        self.dests: dict[str, DestParam] = {}
        self.current: str = "<none>"
        """The checkpoint tensor a loader touched last (blamed for destination writes)."""

    def tensor(self, meta: ParamMeta) -> "RecordingTensor":
        base = torch.empty(meta.shape, dtype=dtype_of(meta.dtype), device="meta")
        return RecordingTensor(base, recorder=self, source=meta.name, ops=(), alias=base, base=base)

    def error(self, rt: "RecordingTensor", op: str, detail: str = "") -> UnsupportedLoaderOp:
        return UnsupportedLoaderOp(tensor=rt._source, op=op, chain=rt.chain(), rank=self.rank, detail=detail)

    def on_copy(self, dest: torch.Tensor, src: "RecordingTensor", op: str) -> None:
        if isinstance(dest, RecordingTensor):
            raise self.error(src, op, "the destination is itself a checkpoint tensor")
        if tuple(dest.shape) != tuple(src.shape):
            raise self.error(src, op, f"broadcasting copy: slice shape {tuple(src.shape)} into destination "
                                      f"shape {tuple(dest.shape)}; only equal shapes are replayable")
        hit = self.resolve(dest)
        if hit is None:
            raise self.error(src, op, f"destination of shape {tuple(dest.shape)} is not a registered "
                                      "parameter (a temporary buffer?): the copy cannot be replayed")
        param, byte_offset, p = hit
        self.dests.setdefault(param, DestParam.of(param, p))
        view = None
        if src._alias is not None and src._alias.dtype == src._root.dtype:
            a = src._alias
            view = StridedView(offset=a.storage_offset(), shape=tuple(a.shape), stride=tuple(a.stride()))
        self.scatters.append(Scatter(
            src=src._source, ops=src._ops, view=view, src_dtype=dtype_name(src.dtype), dst=param,
            dst_byte_offset=byte_offset, dst_dtype=dtype_name(dest.dtype), shape=tuple(dest.shape),
            dst_stride=tuple(dest.stride()),
        ))


    def drop(self, src: str) -> None:
        """Forget what was recorded for ``src`` (it takes the fallback path)."""
        keep = [i for i, s in enumerate(self.scatters) if s.src != src]
        self.fills = [(sum(1 for k in keep if k < pos), f) for pos, f in self.fills if f.src != src]
        self.scatters = [self.scatters[i] for i in keep]
        used = {s.dst for s in self.scatters} | {f.dst for _, f in self.fills}
        self.dests = {n: d for n, d in self.dests.items() if n in used}

    def on_dest_write(self, func, dest: torch.Tensor, args: tuple) -> None:
        """A loader mutated a parameter by other means than copying a checkpoint slice into it."""
        hit = self.resolve(dest)
        assert hit is not None
        param, byte_offset, p = hit
        name = str(func.overloadpacket.__name__)
        if name in ("fill_", "zero_") and (name == "zero_" or not isinstance(args[1], torch.Tensor)):
            value = 0 if name == "zero_" else args[1]
            self.dests.setdefault(param, DestParam.of(param, p))
            self.fills.append((len(self.scatters), Fill(
                src=self.current, pos=0, value=value, dst=param, dst_byte_offset=byte_offset,
                dst_dtype=dtype_name(dest.dtype), shape=tuple(dest.shape), dst_stride=tuple(dest.stride()))))
            return
        raise UnsupportedLoaderOp(tensor=self.current, op=f"{name} on parameter {param!r}", chain="", rank=self.rank,
                                  detail="the loader writes computed values into a parameter; only copies of "
                                         "checkpoint slices and constant fills can be replayed")


class _DestWatch(TorchDispatchMode):
    """During a dry run: record constant fills of parameters, refuse other writes, and never let any
    write reach a parameter (live ones included)."""

    def __init__(self, recorder: Recorder, storages: set[int]):
        super().__init__()
        self.recorder, self.storages = recorder, storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = param_written(func, args, self.storages)
        if t is not None:
            self.recorder.on_dest_write(func, t, args)
            return t
        return func(*args, **(kwargs or {}))


class RecordingTensor(torch.Tensor):
    """A storage-less stand-in for one full checkpoint tensor that records its op chain."""

    _meta: torch.Tensor
    _alias: torch.Tensor | None
    _root: torch.Tensor
    _source: str
    _ops: tuple[Op, ...]
    _recorder: Recorder

    @staticmethod
    def __new__(cls, meta: torch.Tensor, *, recorder: Recorder, source: str, ops: tuple[Op, ...],
                alias: torch.Tensor | None, base: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride(), storage_offset=meta.storage_offset(),
            dtype=meta.dtype, device=recorder.device, requires_grad=False)
        r._meta, r._alias, r._root, r._source, r._ops, r._recorder = meta, alias, base, source, ops, recorder
        return r

    def chain(self) -> str:
        return ".".join(opcodec.render(o.name, o.args, o.kwargs) + (f"[{o.out}]" if o.out >= 0 else "")
                        for o in self._ops)

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105 - never reads values
        return f"RecordingTensor({self._source!r}, shape={tuple(self.shape)}, dtype={self.dtype}, chain={self.chain()!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, is_fn = _op_name(func)
        rt = next((a for a in (*args, *kwargs.values()) if isinstance(a, RecordingTensor)), None)
        if rt is None:  # e.g. a list holding recording tensors (torch.cat)
            rt = next((x for a in args if isinstance(a, (list, tuple)) for x in a
                       if isinstance(x, RecordingTensor)), None)
        if rt is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        rec = rt._recorder
        rec.current = rt._source
        if name in REPR_OPS:
            return repr(rt) if name != "__format__" else format(repr(rt), *args[1:])
        if name == "copy_" and len(args) >= 2 and args[1] is rt:
            rec.on_copy(args[0], rt, "copy_")
            return args[0]
        if name == "__setitem__" and len(args) == 3 and args[2] is rt and not isinstance(args[0], RecordingTensor):
            with torch._C.DisableTorchFunctionSubclass():
                dest = args[0][args[1]]
            rec.on_copy(dest, rt, f"__setitem__[{args[1]!r}]")
            return None
        if args and args[0] is rt:
            if name in META_QUERIES:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(rt._meta, *args[1:], **kwargs)
            if name in DEVICE_QUERIES:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            if name in VIEW_OPS:
                return rt._record(func, name, is_fn, args[1:], kwargs)
        raise rec.error(rt, name, "only view-like ops (narrow, view, transpose, chunk, …) and copy_ into a "
                                  "parameter can be replayed by the trainer")

    def _record(self, func, name: str, is_fn: bool, args: tuple, kwargs: dict):
        rec = self._recorder
        if name in ("view_as", "reshape_as", "expand_as"):  # depend on the other tensor's shape only
            other = args[0]
            name, is_fn, args = name[: -len("_as")], False, (tuple(other.shape),)
            func = getattr(torch.Tensor, name)
        try:
            enc_args = tuple(opcodec.encode(a) for a in args)
            enc_kwargs = {k: opcodec.encode(v) for k, v in kwargs.items()}
        except opcodec.NotEncodable as e:
            raise rec.error(self, name, str(e)) from None
        # advanced indexing / index_select with indices fixed at init (e.g. an EP rank's local experts):
        # the indices are recorded as constants and the gather is replayed (it copies, so no view fold)
        with torch._C.DisableTorchFunctionSubclass():
            try:
                out = func(self._meta, *args, **kwargs)
            except Exception as e:  # the loader would have failed on a real tensor too
                raise rec.error(self, name, f"{type(e).__name__}: {e}") from None
            alias = self._alias
            if alias is not None and name not in IDENTITY_OPS:
                try:
                    alias = func(alias, *args, **kwargs)
                except Exception:
                    alias = None
        def wrap(m: torch.Tensor, a: Any, i: int) -> RecordingTensor:
            if a is not None and (not isinstance(a, torch.Tensor) or not torch._C._is_alias_of(a, self._root)):
                a = None
            op = Op(name=name, fn=is_fn, args=enc_args, kwargs=enc_kwargs, out=i)
            return RecordingTensor(m, recorder=rec, source=self._source, ops=(*self._ops, op), alias=a, base=self._root)

        if isinstance(out, torch.Tensor):
            return wrap(out, alias, -1)
        alias_items = list(alias) if isinstance(alias, (tuple, list)) else [None] * len(out)
        return type(out)(wrap(m, a, i) for i, (m, a) in enumerate(zip(out, alias_items)))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        rt = next((a for a in args if isinstance(a, RecordingTensor)), None)
        src = rt._source if rt is not None else "<unknown>"
        raise UnsupportedLoaderOp(tensor=src, op=str(func), chain=rt.chain() if rt is not None else "",
                                  rank=rt._recorder.rank if rt is not None else None,
                                  detail="reached the dispatcher: the op reads or computes on tensor values")


def record_plan(
    *,
    metadata: Sequence[ParamMeta],
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
    params: Mapping[str, torch.Tensor] | None = None,
    resolve: DestinationResolver | None = None,
    consumer: str = "",
    rank: int | None = None,
    device: torch.device | str = "cpu",
    group_of: Callable[[str], str] = weight_group,
    allow_fallback: bool = False,
) -> Plan:
    """Dry-run ``load_weights`` on recording tensors and return this consumer's sealed plan.

    ``params`` (or a custom ``resolve``) identifies which parameter each ``copy_`` lands in. With
    ``allow_fallback``, a checkpoint tensor whose loader computes values is not refused: it becomes a
    :class:`~shardsync.types.Fallback` (sent whole, loaded by the real loader at sync time) and the dry
    run goes on with the tensors after it. Without it, UnsupportedLoaderOp is raised.
    """
    if params is None:
        raise PlanError("record_plan needs the destination params (they also guard against untracked writes)")
    if resolve is None:
        resolve = storage_resolver(params)
    recorder = Recorder(resolve, rank=rank, device=device)
    storages = {p.untyped_storage()._cdata for p in params.values() if p.numel()}
    by_name = {m.name: m for m in metadata}
    fallbacks: list[Fallback] = []
    todo = list(metadata)
    while todo:
        given: list[ParamMeta] = []

        def weights():
            for m in todo:
                given.append(m)
                yield m.name, recorder.tensor(m)
        try:
            with _DestWatch(recorder, storages):
                load_weights(weights())
            break
        except UnsupportedLoaderOp as e:
            if not allow_fallback or e.tensor not in by_name or any(f.src == e.tensor for f in fallbacks):
                raise
            fallbacks.append(find_fallback(by_name[e.tensor], load_weights, resolve, storages, str(e), rank))
            skip = {f.src for f in fallbacks}
            if given and given[-1].name == e.tensor:  # a lazy loader: what it took before is recorded
                recorder.drop(e.tensor)
                done = {m.name for m in given}
                todo = [m for m in todo if m.name not in done]
            else:  # the loader read ahead (list(weights)): those tensors may never have run; start over
                recorder = Recorder(resolve, rank=rank, device=device)
                todo = [m for m in metadata if m.name not in skip]
    return build_plan(recorder.scatters, metadata, consumer=consumer, group_of=group_of,
                      dests=tuple(recorder.dests.values()), fills=recorder.fills, fallbacks=fallbacks)


def build_plan(scatters: Sequence[Scatter], metadata: Sequence[ParamMeta], *, consumer: str = "",
               group_of: Callable[[str], str] = weight_group, dests: tuple[DestParam, ...] = (),
               fills: Sequence[tuple[int, Fill]] = (), fallbacks: Sequence[Fallback] = ()) -> Plan:
    """Group recorded scatters (and constant fills) by weight group and seal the plan (pure). Each
    fallback adds one whole-tensor scatter into its scratch destination."""
    by_meta = {m.name: m for m in metadata}
    extra = []
    for f in fallbacks:
        m = by_meta[f.src]
        shape = tuple(m.shape)
        stride = tuple(torch.empty(shape, device="meta").stride())
        extra.append(Scatter(src=f.src, ops=(), view=StridedView(offset=0, shape=shape, stride=stride),
                             src_dtype=m.dtype, dst=f.scratch, dst_byte_offset=0, dst_dtype=m.dtype, shape=shape,
                             dst_stride=stride))
        dests = (*dests, DestParam(name=f.scratch, dtype=m.dtype, shape=shape, stride=stride))
    scatters = [*scatters, *extra]
    by_group: dict[str, list[Scatter]] = defaultdict(list)
    fills_by_group: dict[str, list[Fill]] = defaultdict(list)
    fill_iter = iter(fills)
    pending = next(fill_iter, None)
    for i, s in enumerate([*scatters, None]):
        while pending is not None and pending[0] == i:  # a fill recorded before scatter i
            g = group_of(pending[1].src)
            fills_by_group[g].append(msgspec.structs.replace(pending[1], pos=len(by_group[g])))
            pending = next(fill_iter, None)
        if s is not None:
            by_group[group_of(s.src)].append(s)
    used = {s.src for s in scatters}
    order = {m.name: i for i, m in enumerate(metadata)}
    groups = []
    for g in group_order([*by_group, *fills_by_group]):
        ss = tuple(by_group[g])
        sources = tuple(sorted({s.src for s in ss}, key=lambda n: order.get(n, len(order))))
        groups.append(GroupPlan(name=g, scatters=ss, nbytes=sum(s.nbytes for s in ss), sources=sources,
                                fills=tuple(fills_by_group[g])))
    unneeded = tuple(m.name for m in metadata if m.name not in used)
    return Plan(consumer=consumer, meta_digest=metadata_digest(metadata), groups=tuple(groups),
                unneeded=unneeded, dests=tuple(sorted(dests, key=lambda d: d.name)),
                fallback=tuple(fallbacks)).sealed()
