"""The engine's own checkpoint as the reference for the trainer's tensors: their shapes, and which engine tensors a
load writes at all.

vLLM's loaders ``narrow`` a checkpoint tensor to the rank's part, so a trainer tensor that is LARGER than the
engine's (a trainer configured with ``intermediate_size`` 384 for an engine of 256) records as a valid plan, and a
sync would then load the trainer's weights truncated — a model that exists nowhere. Refused at init instead: every
trainer tensor whose name the engine's checkpoint holds must have the shape the checkpoint gives it (dtypes may
differ — the loaders cast). And an engine tensor that loading the engine's own checkpoint leaves unwritten too (FP8
online quantisation's ``weight_scale``: processing computes it) is not one the trainer must fill
(``layerwise._require_coverage``). Only the safetensors headers are read; an engine started without a local
safetensors checkpoint (a hub id not in the local cache, ``load_format="dummy"``) has no reference for either.
"""

from __future__ import annotations

import glob
import os
from typing import Sequence

from ...errors import MetadataMismatch
from ...types import ParamMeta

__all__ = ["checkpoint_metadata", "checkpoint_shapes", "engine_checkpoint", "refuse_foreign_shapes"]

MAX_SHOWN = 5
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "U8": "uint8",
           "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}


def checkpoint_metadata(model_dir: str) -> dict[str, ParamMeta] | None:
    """Every tensor's name, dtype and shape from the safetensors headers under ``model_dir``; None if it holds
    none. A dtype torch has no name for here keeps safetensors' own (``F8_E8M0``...)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))) if os.path.isdir(model_dir) else []
    if not files:
        return None
    from safetensors import safe_open

    out: dict[str, ParamMeta] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = ParamMeta(name=k, dtype=_DTYPES.get(sl.get_dtype(), sl.get_dtype()),
                                   shape=tuple(sl.get_shape()))
    return out


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of the checkpoint under ``model_dir``; None if it holds no safetensors."""
    metas = checkpoint_metadata(model_dir)
    return None if metas is None else {k: tuple(m.shape) for k, m in metas.items()}


def engine_checkpoint(vllm_config) -> tuple[str, dict[str, ParamMeta]] | None:
    """The directory the engine loaded from and its checkpoint's tensors; None without a local reference."""
    model_dir = getattr(getattr(vllm_config, "model_config", None), "model", None)
    metas = checkpoint_metadata(model_dir) if isinstance(model_dir, str) else None
    return (model_dir, metas) if metas else None


def refuse_foreign_shapes(metadata: Sequence[ParamMeta], vllm_config, *, rank: int) -> None:
    """:class:`MetadataMismatch` naming each trainer tensor whose shape the engine's checkpoint does not have."""
    ref = engine_checkpoint(vllm_config)
    if ref is None:
        return
    model_dir, metas = ref
    shapes = {k: tuple(m.shape) for k, m in metas.items()}
    bad = [(m.name, list(m.shape), list(shapes[m.name])) for m in metadata
           if m.name in shapes and tuple(m.shape) != shapes[m.name]]
    if bad:
        shown = "; ".join(f"{n!r}: trainer {a}, engine {b}" for n, a, b in bad[:MAX_SHOWN])
        raise MetadataMismatch(
            f"rank {rank}: {len(bad)} trainer tensor(s) have a shape the engine's checkpoint ({model_dir}) does not "
            f"give them: {shown}{' ...' if len(bad) > MAX_SHOWN else ''} — the trainer's model and the engine's are "
            "configured differently; a sync would load them cut to the engine's shape")
