"""Pure data records shared by every stage: metadata, op chains, scatters, plans.

All records are frozen, keyword-only msgspec Structs. They encode to JSON (never pickle) with
``to_dict``/``from_dict`` and carry a stable content digest so ranks can confirm they agree::

    meta = ParamMeta(name="model.norm.weight", dtype="bfloat16", shape=(64,))
    assert ParamMeta.from_dict(meta.to_dict()) == meta
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import msgspec
import torch

__all__ = [
    "ParamMeta", "DestParam", "Op", "Fill", "StridedView", "Scatter", "GroupPlan", "Plan",
    "dtype_name", "dtype_of", "metadata_digest", "digest_of",
]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ValueError for an unknown name."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


def itemsize(dtype: str) -> int:
    return dtype_of(dtype).itemsize


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return msgspec.convert(d, cls)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self, order="deterministic")

    @classmethod
    def from_json(cls, data: bytes | str):
        return msgspec.json.decode(data, type=cls)


def digest_of(obj: Any) -> str:
    """sha256 (hex, 16 bytes) of the deterministic JSON encoding of ``obj``."""
    return hashlib.sha256(msgspec.json.encode(obj, order="deterministic")).hexdigest()[:32]


class ParamMeta(_Record):
    """One trainer tensor, in HuggingFace checkpoint format."""

    name: str
    """Checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    dtype: str
    """torch dtype without the ``torch.`` prefix, e.g. ``bfloat16``."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "ParamMeta":
        return cls(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape))


def metadata_digest(metas: Sequence[ParamMeta]) -> str:
    """Digest of a metadata list, order included: both sides must list tensors identically."""
    return digest_of(list(metas))


class Op(_Record):
    """One recorded tensor operation of a loader's op chain."""

    name: str
    """``torch.Tensor`` method / property or ``torch`` function name, e.g. ``narrow``, ``__getitem__``."""
    fn: bool = False
    """True if recorded as a ``torch.<name>`` function call, False for a ``Tensor`` method or property."""
    args: tuple[Any, ...] = ()
    """Positional arguments after the tensor itself, encoded by :mod:`shardsync.opcodec`."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments, encoded likewise."""
    out: int = -1
    """Index into a multi-output result (chunk / split / unbind); -1 for a single tensor result."""


class StridedView(_Record):
    """An op chain folded into one ``as_strided`` view of the full, contiguous source tensor."""

    offset: int
    """Storage offset in source elements."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class Scatter(_Record):
    """One recorded ``copy_``: a slice of a checkpoint tensor -> a region of a parameter."""

    src: str
    """Checkpoint tensor name."""
    ops: tuple[Op, ...]
    """Op chain applied to the full checkpoint tensor to get the slice, in order."""
    view: StridedView | None
    """The chain as one strided view of the source, or None when it is not a pure view."""
    src_dtype: str
    """dtype of the slice before ``copy_`` (after any dtype views)."""
    dst: str
    """Destination parameter name (the engine's name)."""
    dst_byte_offset: int
    """Byte offset of the destination region from the parameter's first byte."""
    dst_dtype: str
    """dtype of the destination view (the packed bytes are in this dtype)."""
    shape: tuple[int, ...]
    """Shape of the slice and of the destination view (equal: broadcasting copies are refused)."""
    dst_stride: tuple[int, ...]
    """Strides of the destination view, in ``dst_dtype`` elements."""

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the slice in the destination dtype."""
        return self.numel * itemsize(self.dst_dtype)


class Fill(_Record):
    """A constant a loader writes into a parameter region (``fill_``/``zero_``: vocab padding rows)."""

    src: str
    """Checkpoint tensor being loaded when the loader wrote it."""
    pos: int
    """Number of this group's scatters recorded before it: replay applies it at the same point."""
    value: float | int | bool
    dst: str
    dst_byte_offset: int
    dst_dtype: str
    shape: tuple[int, ...]
    dst_stride: tuple[int, ...]


class GroupPlan(_Record):
    """All scatters of one weight group for one consumer, in recorded order."""

    name: str
    """Weight group name (see :func:`shardsync.groups.weight_group`)."""
    scatters: tuple[Scatter, ...]
    nbytes: int
    """Sum of the scatters' payload bytes (alignment padding excluded)."""
    sources: tuple[str, ...]
    """Checkpoint names this group needs, in metadata order."""
    fills: tuple[Fill, ...] = ()
    """Constant writes of the loaders, applied at their recorded position (no bytes on the wire)."""


FALLBACK_PREFIX = "shardsync.fallback:"
"""Destination names ``FALLBACK_PREFIX + src``: a scratch buffer the whole source tensor lands in, handed
to the engine's real loader at sync time (see :class:`Fallback`)."""


class Fallback(_Record):
    """A checkpoint tensor whose loader computes values (``A = -exp(A_log)``, ``w * 2``): no trainer-side
    view can replay it, so the consumer receives the tensor whole (one scatter into
    ``FALLBACK_PREFIX + src``) and runs the engine's real loader on it at sync time."""

    src: str
    """Checkpoint tensor name."""
    dests: tuple[str, ...]
    """Parameters that loader writes (found by a dry run on a plain meta tensor)."""
    reason: str
    """Why it could not be recorded (the UnsupportedLoaderOp's text)."""

    @property
    def scratch(self) -> str:
        return FALLBACK_PREFIX + self.src


class DestParam(_Record):
    """Layout of one destination parameter as seen when the plan was recorded."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "DestParam":
        return cls(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape), stride=tuple(t.stride()))


class Plan(_Record):
    """One consumer's plan: what it needs of every checkpoint tensor and where it goes."""

    consumer: str
    """Free-form consumer label, e.g. ``replica0/tp1``."""
    meta_digest: str
    """Digest of the trainer metadata the plan was recorded against."""
    groups: tuple[GroupPlan, ...]
    """Weight groups in transfer order (pre, layers ascending, post)."""
    unneeded: tuple[str, ...]
    """Checkpoint names that never reached a ``copy_`` on this consumer: never sent to it."""
    dests: tuple[DestParam, ...] = ()
    """Every parameter the plan writes, with the layout it had at recording time (checked at apply)."""
    fallback: tuple[Fallback, ...] = ()
    """Checkpoint tensors loaded by the engine's real loader at sync time (whole tensor on the wire)."""
    digest: str = ""
    """Content digest of everything above except ``consumer``; filled by :meth:`sealed`."""

    def content_digest(self) -> str:
        return digest_of([self.meta_digest, self.groups, self.unneeded, self.dests, self.fallback])

    def sealed(self) -> "Plan":
        return msgspec.structs.replace(self, digest=self.content_digest())

    def verify_digest(self) -> None:
        from .errors import PlanError

        if self.digest != self.content_digest():
            raise PlanError(f"plan of consumer {self.consumer!r}: digest {self.digest!r} does not match its content")

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        from .errors import PlanError

        raise PlanError(f"plan of consumer {self.consumer!r} has no weight group {name!r}")
