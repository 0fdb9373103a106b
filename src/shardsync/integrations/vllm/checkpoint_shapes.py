"""The engine's own checkpoint as the reference for the trainer's tensor shapes.

vLLM's loaders ``narrow`` a checkpoint tensor to the rank's part, so a trainer tensor that is LARGER than the
engine's (a trainer configured with ``intermediate_size`` 384 for an engine of 256) records as a valid plan, and a
sync would then load the trainer's weights truncated — a model that exists nowhere. Refused at init instead: every
trainer tensor whose name the engine's checkpoint holds must have the shape the checkpoint gives it (dtypes may
differ — the loaders cast). Only the safetensors headers are read; an engine started without a local safetensors
checkpoint (a hub id not in the local cache, ``load_format="dummy"``) has no reference and is not checked here.
"""

from __future__ import annotations

import glob
import os
from typing import Sequence

from ...errors import MetadataMismatch
from ...types import ParamMeta

__all__ = ["checkpoint_shapes", "refuse_foreign_shapes"]

MAX_SHOWN = 5


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` from the safetensors headers under ``model_dir``; None if it holds none."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))) if os.path.isdir(model_dir) else []
    if not files:
        return None
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                out[k] = tuple(h.get_slice(k).get_shape())
    return out


def refuse_foreign_shapes(metadata: Sequence[ParamMeta], vllm_config, *, rank: int) -> None:
    """:class:`MetadataMismatch` naming each trainer tensor whose shape the engine's checkpoint does not have."""
    model_dir = getattr(getattr(vllm_config, "model_config", None), "model", None)
    shapes = checkpoint_shapes(model_dir) if isinstance(model_dir, str) else None
    if not shapes:
        return
    bad = [(m.name, list(m.shape), list(shapes[m.name])) for m in metadata
           if m.name in shapes and tuple(m.shape) != shapes[m.name]]
    if bad:
        shown = "; ".join(f"{n!r}: trainer {a}, engine {b}" for n, a, b in bad[:MAX_SHOWN])
        raise MetadataMismatch(
            f"rank {rank}: {len(bad)} trainer tensor(s) have a shape the engine's checkpoint ({model_dir}) does not "
            f"give them: {shown}{' ...' if len(bad) > MAX_SHOWN else ''} — the trainer's model and the engine's are "
            "configured differently; a sync would load them cut to the engine's shape")
