"""Byte-exact packed layout of one weight group, computed identically on both sides.

The producer replays each scatter's op chain on the full tensor and writes the slice, converted to
the destination dtype, at its aligned offset in one contiguous byte buffer; the consumer views the
same offsets and copies them into its parameters. Copies are batched with ``torch._foreach_copy_``
(one call per chunk on each side), never one Python-level copy per slice::

    layout = layout_group(plan.group("model.layers.0"))
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    GroupPacker(plan.group("model.layers.0"), layout).pack(full_tensors, buf)
    GroupUnpacker(plan.group("model.layers.0"), layout).unpack(buf, params)

A consumer that reads a group's chunks where they lie (a producer's ring mapped into its process: direct reads)
hands ``unpack`` a :class:`ChunkParts` instead of one group buffer: each chunk's bytes, wherever they are::

    GroupUnpacker(g, layout).unpack(ChunkParts([(0, ring[off0: off0 + n0]), (1, ring[off1: off1 + n1])]), params)
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Callable, Hashable, Mapping

import msgspec
import torch

from ..errors import PlanError, SyncError
from ..types import DestParam, Fill, GroupPlan, Plan, Scatter, dtype_of
from . import opcodec
from .viewcache import Uncacheable, _Views

__all__ = ["ALIGN", "Chunk", "GroupLayout", "layout_group", "replay", "dst_view", "check_dests", "GroupPacker",
           "GroupUnpacker", "ChunkParts", "Sources"]

ALIGN = 64
"""Every slice starts at a multiple of this many bytes (vectorised copies, GPU-friendly)."""
DEFAULT_CHUNK_BYTES = 64 << 20


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class Chunk(msgspec.Struct, frozen=True, kw_only=True):
    """A contiguous byte range of a group buffer: one pull."""

    index: int
    start: int
    """First byte (aligned)."""
    nbytes: int
    first: int
    """First scatter index in the chunk."""
    stop: int
    """One past the last scatter index in the chunk."""


class GroupLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Offsets of every scatter of one group and the chunks they are pulled in."""

    group: str
    offsets: tuple[int, ...]
    """Byte offset of scatter i in the group buffer."""
    chunks: tuple[Chunk, ...]
    nbytes: int
    """Total buffer size, alignment padding included."""


def layout_group(g: GroupPlan, *, align: int = ALIGN, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 split_key: Callable[[Scatter], Hashable] | None = None) -> GroupLayout:
    """Pure: aligned offsets in recorded order, cut into chunks of at most ``max_chunk_bytes``
    (a single slice larger than that gets a chunk of its own). ``split_key`` also cuts wherever its
    value changes between consecutive slices (e.g. the set of producers holding the source, so that
    each chunk can be pulled from one producer)."""
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    offsets: list[int] = []
    chunks: list[Chunk] = []
    pos = start = first = 0
    key = None
    for i, s in enumerate(g.scatters):
        n = s.nbytes
        off = _align(pos, align)
        k = split_key(s) if split_key is not None else None
        if i > first and (off + n - start > max_chunk_bytes or k != key):
            chunks.append(Chunk(index=len(chunks), start=start, nbytes=pos - start, first=first, stop=i))
            start = off
            first = i
        offsets.append(off)
        pos = off + n
        key = k
    if g.scatters:
        chunks.append(Chunk(index=len(chunks), start=start, nbytes=pos - start, first=first, stop=len(g.scatters)))
    return GroupLayout(group=g.name, offsets=tuple(offsets), chunks=tuple(chunks), nbytes=_align(pos, align))


def replay(s: Scatter, full: torch.Tensor) -> torch.Tensor:
    """The slice a scatter takes of ``full``: one strided view when the plan folded the chain,
    else the recorded op chain replayed op by op."""
    if s.view is not None and full.is_contiguous():
        v = s.view
        return full.as_strided(v.shape, v.stride, full.storage_offset() + v.offset)
    t = full
    for op in s.ops:
        t = apply_op(t, op, tuple(_on(opcodec.decode(a), t.device) for a in op.args),
                     {k: _on(opcodec.decode(v), t.device) for k, v in op.kwargs.items()})
    return t


def apply_op(t: torch.Tensor, op, args: tuple, kwargs: dict) -> torch.Tensor:
    """One recorded op on ``t`` with decoded arguments; an op outside the recorder's allow-list is refused here
    too (a plan that reached a producer unchecked still cannot make it call an arbitrary torch function)."""
    if op.name not in opcodec.VIEW_OPS:
        raise PlanError(f"op {op.name!r} is not one the recorder produces; refusing to replay it")
    if op.name in ("T", "mT", "data"):
        t = getattr(t, op.name)
    elif op.fn:
        t = getattr(torch, op.name)(t, *args, **kwargs)
    else:
        t = getattr(torch.Tensor, op.name)(t, *args, **kwargs)
    return t[op.out] if op.out >= 0 else t


def _on(x, device: torch.device):
    """Constant index tensors follow the tensor they index."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_on(i, device) for i in x)
    return x


def dst_view(param: torch.Tensor, s: Scatter | Fill) -> torch.Tensor:
    """The region of ``param`` that scatter (or fill) ``s`` writes, as a tensor of ``s.dst_dtype``."""
    dt = dtype_of(s.dst_dtype)
    base_byte = param.storage_offset() * param.element_size() + s.dst_byte_offset
    if base_byte % dt.itemsize:
        raise PlanError(f"scatter {s.src!r} -> {s.dst!r}: byte offset {base_byte} not a multiple of {dt}")
    p = param.detach()
    try:
        if dt == p.dtype:
            return p.as_strided(s.shape, s.dst_stride, base_byte // dt.itemsize)
        return torch.empty(0, dtype=dt, device=p.device).set_(
            p.untyped_storage(), base_byte // dt.itemsize, s.shape, s.dst_stride)
    except RuntimeError as e:
        raise PlanError(f"scatter {s.src!r} -> {s.dst!r}: destination region {s.dst_dtype}{list(s.shape)} "
                        f"at byte {s.dst_byte_offset} does not fit the parameter "
                        f"{str(param.dtype)}{list(param.shape)}: {e}") from None


def check_dests(plan: "Plan", params: Mapping[str, torch.Tensor]) -> None:
    """Raise PlanError unless every parameter the plan writes exists with its recorded layout."""
    for d in plan.dests:
        p = params.get(d.name)
        if p is None:
            raise PlanError(f"consumer {plan.consumer!r}: plan writes parameter {d.name!r}, which it lacks")
        found = DestParam.of(d.name, p)
        if found != d:
            raise PlanError(f"consumer {plan.consumer!r}: parameter {d.name!r} is {found.dtype}{list(found.shape)} "
                            f"stride {list(found.stride)}, the plan was recorded for {d.dtype}{list(d.shape)} "
                            f"stride {list(d.stride)}")


def _packed_view(buf: torch.Tensor, off: int, s: Scatter) -> torch.Tensor:
    return buf[off: off + s.nbytes].view(dtype_of(s.dst_dtype)).view(s.shape)


class ChunkParts:
    """A group's chunks wherever they landed: ``[(chunk, its bytes as a contiguous uint8 tensor), ...]`` (a direct
    read leaves them in the producer's mapped ring). The chunks are the reader's (its ``GroupLayout``'s, cut where
    the holding producer changes); byte offsets are the same in every layout of the group, so any unpacker of the
    group can scatter them."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[tuple[Chunk, torch.Tensor]]):
        self.parts = sorted(parts, key=lambda x: x[0].first)


class Sources:
    """A chunk's full tensors where they lie (source reads: the producer's own tensors, mapped into this process), in
    place of its packed bytes inside :class:`ChunkParts`: the unpacker replays each scatter's op chain on them and
    copies straight into the parameters (one pass; the packed bytes would be the same values, converted the same)."""

    __slots__ = ("tensors", "serial")

    def __init__(self, tensors: Mapping[str, torch.Tensor], serial: int | None = None):
        self.tensors = tensors
        self.serial = serial
        """Given by an owner that keeps ``tensors`` alive and never changes them: a number it never gives other
        tensors (the unpacker then checks only the parameters each call, not the sources)."""


class GroupPacker:
    """Producer side of one group of one plan: replay + pack. Views of tensors that stay the same between
    calls (module parameters, the ring) are built once and reused."""

    def __init__(self, g: GroupPlan, layout: GroupLayout):
        self.g, self.layout = g, layout
        self._views = _Views()
        self._srcs = {c.index: list(dict.fromkeys(s.src for s in g.scatters[c.first:c.stop])) for c in layout.chunks}

    def pack(self, full: Mapping[str, torch.Tensor], buf: torch.Tensor, chunk: Chunk | None = None,
             *, base: int = 0, gen: int | None = None) -> None:
        """Write the slices of ``chunk`` (all chunks if None) into ``buf``, whose byte 0 is group byte
        ``base`` (so a chunk-sized buffer takes ``base=chunk.start``). ``gen``: a generation the caller bumps
        whenever a tensor it passes may have changed (object, storage, strides); while it stays the same the
        cached views are used without checking the tensors (the producer's ``SameBatches.generation``)."""
        chunks = self.layout.chunks if chunk is None else (chunk,)
        for c in chunks:
            names = self._srcs[c.index]
            tensors = list(map(full.get, names))
            if any(map(operator.is_, tensors, repeat(None))):
                n = names[[t is None for t in tensors].index(True)]
                raise SyncError(f"group {self.g.name!r}: full tensor {n!r} missing on the producer")
            views, rp = self._views.get((c.index, buf.data_ptr(), buf.numel(), base), tensors,
                                        lambda c=c: self._build(full, buf, c, base), gen)  # type: ignore[misc]
            dsts, srcs = views  # type: ignore[misc]
            if not dsts:
                continue
            if rp is None:
                torch._foreach_copy_(dsts, srcs)
            else:
                rp.run(lambda d=dsts, s=srcs: torch._foreach_copy_(d, s), device=buf.device)

    def _build(self, full: Mapping[str, torch.Tensor], buf: torch.Tensor, c: Chunk, base: int) -> object:
        idx = range(c.first, c.stop)
        sc = self.g.scatters
        views = ([_packed_view(buf, self.layout.offsets[i] - base, sc[i]) for i in idx],
                 [replay(sc[i], full[sc[i].src]) for i in idx])
        fresh = any(sc[i].view is None and src.untyped_storage().data_ptr() !=
                    full[sc[i].src].untyped_storage().data_ptr() for i, src in zip(idx, views[1]))
        return Uncacheable(views) if fresh else views


class GroupUnpacker:
    """Consumer side of one group of one plan: unpack + scatter into the parameters. The copy program of a
    chunk (views of the buffer and of the parameters, fills in between) is built once per buffer and reused
    while the parameters stay the same tensors."""

    def __init__(self, g: GroupPlan, layout: GroupLayout):
        self.g, self.layout = g, layout
        self._views = _Views(cap=max(64, 8 * len(layout.chunks)))
        self._dsts: dict[tuple[int, int], list[str]] = {}
        """(first, stop) of a chunk -> the parameters its copies and fills write."""
        self._serials: dict[tuple[int, int], tuple] = {}
        """(first, stop) of a chunk -> the view-cache key of the sources it was last scattered from."""
        self._srcs: dict[tuple[int, int], list[str]] = {}
        """(first, stop) of a chunk -> the full tensors its scatters read (source reads)."""

    def unpack(self, buf: torch.Tensor | ChunkParts, params: Mapping[str, torch.Tensor], chunk: Chunk | None = None,
               *, base: int = 0) -> None:
        """Copy the slices of ``chunk`` (all chunks if None) into ``params``; the loaders' constant fills
        run at their recorded positions (fills after the last scatter run with the last chunk). ``buf``: the
        group buffer, or :class:`ChunkParts` (every chunk of the group, each where it lies)."""
        if isinstance(buf, ChunkParts):
            spans = [(c.first, c.stop) for c, _ in buf.parts]
            n = len(self.g.scatters)
            if not buf.parts and not n:
                return self.unpack(torch.empty(0, dtype=torch.uint8), params)
            if [a for a, _ in spans] != [0, *(b for _, b in spans[:-1])] or not spans or spans[-1][1] != n:
                raise SyncError(f"group {self.g.name!r}: the parts to unpack cover scatters {spans}, not [0, {n})")
            for c, data in buf.parts:
                if isinstance(data, Sources):
                    self._unpack_sources(data.tensors, params, c, data.serial)
                    continue
                if data.numel() < c.nbytes or self.layout.offsets[c.first] != c.start:
                    raise SyncError(f"group {self.g.name!r}: a part of {data.numel()} bytes at group byte {c.start} "
                                    f"for scatters [{c.first}, {c.stop}) does not match the layout")
                self.unpack(data, params, c, base=c.start)
            return None
        chunks = self.layout.chunks if chunk is None else (chunk,)
        n = len(self.g.scatters)
        with torch.no_grad():
            if not chunks and self.g.fills:  # a group made of fills only
                self._fill(params, 0, n + 1)
            for c in chunks:
                names = self._dests(c)
                tensors = list(map(params.get, names))
                if any(map(operator.is_, tensors, repeat(None))):
                    _param(params, names[[t is None for t in tensors].index(True)], self.g.name)
                steps, rp = self._views.get((c.first, c.stop, buf.data_ptr(), buf.numel(), base), tensors,
                                            lambda c=c: self._program(buf, params, c, base))
                if rp is None:
                    _run_steps(steps)
                else:
                    rp.run(lambda s=steps: _run_steps(s), device=buf.device)

    def _unpack_sources(self, full: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], c: Chunk,
                        serial: int | None) -> None:
        sc = self.g.scatters
        names = self._dests(c)
        srcs = self._srcs.get((c.first, c.stop))
        if srcs is None:
            srcs = self._srcs[(c.first, c.stop)] = list(dict.fromkeys(s.src for s in sc[c.first:c.stop]))
        tensors = list(map(params.get, names))
        if any(map(operator.is_, tensors, repeat(None))):
            _param(params, names[[t is None for t in tensors].index(True)], self.g.name)
        if serial is None:  # sources the caller does not vouch for: checked like the parameters, every call
            tensors += map(full.get, srcs)
        missing = [n for n in srcs if n not in full] if serial is None else ()
        if missing:
            raise SyncError(f"group {self.g.name!r}: source tensor {missing[0]!r} missing")

        def build() -> object:
            try:
                steps = self._program(None, params, c, 0, src=lambda i: replay(sc[i], full[sc[i].src]))
            except KeyError as e:
                raise SyncError(f"group {self.g.name!r}: source tensor {e.args[0]!r} missing") from None
            fresh = any(sc[i].view is None and not _same_storage(v, full[sc[i].src])
                        for i, v in zip(range(c.first, c.stop), (x for st in steps for x in st[1])))
            return Uncacheable(steps) if fresh else steps

        key = (c.first, c.stop, "sources", serial)
        old = self._serials.get((c.first, c.stop))
        if old is not None and old != key:  # new sources: the old views (and the mappings they keep) go
            self._views.by_key.pop(old, None)
        self._serials[(c.first, c.stop)] = key
        with torch.no_grad():
            steps, rp = self._views.get(key, tensors, build)
            if rp is None:
                _run_steps(steps)
            else:
                rp.run(lambda s=steps: _run_steps(s), device=tensors[0].device)

    def read_back(self, params: Mapping[str, torch.Tensor], buf: torch.Tensor, chunk: Chunk, *, base: int = 0) -> None:
        """The inverse of ``unpack`` for one chunk: its slices copied out of ``params`` into ``buf`` (whose byte 0 is
        group byte ``base``) and its alignment gaps zeroed — the bytes a delta producer packs (it zeroes gaps too).
        Exact only where each scatter's region is its own (``plan/readback.py`` decides that)."""
        off, sc = self.layout.offsets, self.g.scatters
        dsts, srcs, gaps = [], [], []
        end = chunk.start
        for i in range(chunk.first, chunk.stop):
            s = sc[i]
            if off[i] > end:
                gaps.append(buf[end - base: off[i] - base])
            dsts.append(_packed_view(buf, off[i] - base, s))
            srcs.append(dst_view(_param(params, s.dst, self.g.name), s))
            end = off[i] + s.nbytes
        with torch.no_grad():
            if gaps:
                torch._foreach_zero_(gaps)
            if dsts:
                torch._foreach_copy_(dsts, srcs)

    def _dests(self, c: Chunk) -> list[str]:
        key = (c.first, c.stop)
        d = self._dsts.get(key)
        if d is None:
            d = self._dsts[key] = list(dict.fromkeys(s.dst for s in self.g.scatters[c.first:c.stop])) \
                + [f.dst for f in self.g.fills if c.first <= f.pos <= c.stop]
        return d

    def _program(self, buf: torch.Tensor | None, params: Mapping[str, torch.Tensor], c: Chunk, base: int,
                 src: Callable[[int], torch.Tensor] | None = None) -> list:
        """[(dsts, srcs, fills before them)], the fills at their recorded positions; ``src(i)``: scatter i's source
        (default: its packed bytes in ``buf``)."""
        n = len(self.g.scatters)
        steps: list = []
        dsts: list = []
        srcs: list = []
        for i in range(c.first, c.stop):
            fills = [f for f in self.g.fills if f.pos == i]
            if fills:
                steps.append((dsts, srcs, []))
                dsts, srcs = [], []
                steps.append(([], [], [(dst_view(_param(params, f.dst, self.g.name), f), f.value) for f in fills]))
            s = self.g.scatters[i]
            dsts.append(dst_view(_param(params, s.dst, self.g.name), s))
            srcs.append(src(i) if src is not None else _packed_view(buf, self.layout.offsets[i] - base, s))
        steps.append((dsts, srcs, []))
        if c.stop == n:
            steps.append(([], [], [(dst_view(_param(params, f.dst, self.g.name), f), f.value)
                                   for f in self.g.fills if f.pos == n]))
        return steps

    def _fill(self, params: Mapping[str, torch.Tensor], lo: int, hi: int) -> None:
        for f in self.g.fills:
            if lo <= f.pos < hi:
                dst_view(_param(params, f.dst, self.g.name), f).fill_(f.value)


def _same_storage(view: torch.Tensor, full: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


def _run_steps(steps) -> None:
    for dsts, srcs, fills in steps:
        for v, value in fills:
            v.fill_(value)
        if dsts:
            torch._foreach_copy_(dsts, srcs)


def _param(params: Mapping[str, torch.Tensor], name: str, group: str) -> torch.Tensor:
    p = params.get(name)
    if p is None:
        raise SyncError(f"group {group!r}: destination parameter {name!r} not found")
    return p
