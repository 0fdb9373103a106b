"""JSON-safe encoding of op arguments (ints, tuples, slices, Ellipsis, None, dtypes, and constant
integer / bool index tensors fixed at init, e.g. the local experts of an expert-parallel rank).

    >>> decode(encode((slice(0, 4), Ellipsis, None)))
    (slice(0, 4, None), Ellipsis, None)
"""

from __future__ import annotations

from typing import Any

import torch

from ..types import dtype_name, dtype_of


class NotEncodable(TypeError):
    """An argument that cannot be part of a replayable op (a float tensor, an object, …)."""


MAX_INDEX_ELEMENTS = 1 << 20
"""Largest constant index tensor a plan may carry (bounds what a peer's plan can make a trainer build)."""
_INDEX_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool")
_MEMORY_FORMATS = ("contiguous_format", "preserve_format", "channels_last", "channels_last_3d")


def encode(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.SymInt):  # pragma: no cover - no symbolic shapes in recording
        return int(x)
    if isinstance(x, (tuple, torch.Size)):
        return {"T": [encode(v) for v in x]}
    if isinstance(x, list):
        return {"L": [encode(v) for v in x]}
    if isinstance(x, slice):
        return {"S": [encode(x.start), encode(x.stop), encode(x.step)]}
    if x is Ellipsis:
        return {"E": 0}
    if isinstance(x, torch.dtype):
        return {"D": dtype_name(x)}
    if isinstance(x, torch.memory_format):
        return {"M": str(x).removeprefix("torch.")}
    if isinstance(x, torch.Tensor) and type(x) is torch.Tensor and not x.is_meta:
        name = dtype_name(x.dtype)
        if name not in _INDEX_DTYPES or x.numel() > MAX_INDEX_ELEMENTS:
            raise NotEncodable(f"only integer/bool index tensors of <= {MAX_INDEX_ELEMENTS} elements are recorded "
                               f"as constants; got {name} of shape {tuple(x.shape)}")
        return {"X": [name, list(x.shape), x.detach().cpu().reshape(-1).tolist()]}
    raise NotEncodable(f"cannot record argument of type {type(x).__name__}: {x!r}"[:200])


def decode(x: Any) -> Any:
    if not isinstance(x, dict):
        return x
    ((k, v),) = x.items()
    if k == "T":
        return tuple(decode(i) for i in v)
    if k == "L":
        return [decode(i) for i in v]
    if k == "S":
        return slice(*(decode(i) for i in v))
    if k == "E":
        return Ellipsis
    if k == "D":
        return dtype_of(v)
    if k == "M":
        if v not in _MEMORY_FORMATS:
            raise ValueError(f"unknown memory format {v!r}")
        return getattr(torch, v)
    if k == "X":
        name, shape, values = v
        if name not in _INDEX_DTYPES or len(values) > MAX_INDEX_ELEMENTS or len(values) != _numel(shape):
            raise ValueError(f"bad constant index tensor: dtype {name!r}, shape {shape}, {len(values)} values")
        return torch.tensor(values, dtype=dtype_of(name)).reshape(shape)
    raise ValueError(f"unknown encoded argument {x!r}")


def _numel(shape: list) -> int:
    n = 1
    for s in shape:
        if not isinstance(s, int) or s < 0:
            return -1
        n *= s
    return n


def render(name: str, args: tuple, kwargs: dict) -> str:
    """Human-readable form of one op, for error messages: ``narrow(0, 64, 64)``."""
    parts = [_short(a) for a in args] + [f"{k}={decode(v)!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _short(a: Any) -> str:
    if isinstance(a, dict) and "X" in a:
        name, shape, values = a["X"]
        return f"tensor({values[:8]}{'…' if len(values) > 8 else ''}, dtype={name}, shape={tuple(shape)})"
    return repr(decode(a))


# Every op a plan may name: what the recorder produces. Producers replay nothing else (pack.apply_op).
VIEW_OPS = frozenset({
    "narrow", "view", "reshape", "transpose", "t", "T", "mT", "permute", "flatten", "unflatten",
    "squeeze", "unsqueeze", "contiguous", "chunk", "split", "tensor_split", "unbind", "select",
    "__getitem__", "expand", "movedim", "moveaxis", "swapaxes", "swapdims", "view_as", "reshape_as",
    "expand_as", "detach", "clone", "data", "split_with_sizes", "index_select",
})
