"""JSON-safe encoding of op arguments (ints, tuples, slices, Ellipsis, None, dtypes).

    >>> decode(encode((slice(0, 4), Ellipsis, None)))
    (slice(0, 4, None), Ellipsis, None)
"""

from __future__ import annotations

from typing import Any

import torch

from ..types import dtype_name, dtype_of


class NotEncodable(TypeError):
    """An argument that cannot be part of a replayable op (a tensor, an object, …)."""


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
        return getattr(torch, v)
    raise ValueError(f"unknown encoded argument {x!r}")


def render(name: str, args: tuple, kwargs: dict) -> str:
    """Human-readable form of one op, for error messages: ``narrow(0, 64, 64)``."""
    parts = [repr(decode(a)) for a in args] + [f"{k}={decode(v)!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"
