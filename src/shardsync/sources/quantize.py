"""A bf16 trainer into an engine that serves a block-FP8 checkpoint (the DeepSeek-V3 / Kimi-K2 format: float8_e4m3fn
weights with a float32 ``weight_scale_inv`` per 128x128 tile). ``BlockFP8Source`` wraps the trainer's source and
presents its weights as that checkpoint holds them: each named weight becomes its FP8 bytes and its scales, made on
the trainer (``kernels.fp8.block_fp8``) per group as the group is gathered, so half the bytes cross the link and the
engine loads them exactly as it loads its checkpoint at start-up::

    src = BlockFP8Source.for_checkpoint(ModuleSource(model), "/ckpt/deepseek-v3")   # names and block from the files
    producer = Producer(src, cfg)

The result equals a fresh engine started on the same bf16 weights quantised by the same function
(``verify.checkpoints.to_block_fp8``), byte for byte; against a checkpoint quantised by another tool the FP8 bytes
differ where that tool rounds differently.
"""

from __future__ import annotations

import json
import os
from typing import Any, Collection, Iterator

import torch

from ..errors import MetadataMismatch
from ..kernels.fp8 import BLOCK, block_fp8
from ..source import Batch, WeightSource
from ..types import ParamMeta, dtype_name
from .adapt import adapt

__all__ = ["BlockFP8Source", "block_fp8_names"]

SCALE_SUFFIX = "_scale_inv"
MAX_NAMES = 1 << 20


def block_fp8_names(checkpoint: str) -> tuple[list[str], tuple[int, int]]:
    """The weights a block-FP8 checkpoint stores as float8_e4m3fn with a ``<name>_scale_inv`` partner, and its block
    (``quantization_config.weight_block_size``), read from the safetensors headers (no tensor is loaded)."""
    import glob

    from safetensors import safe_open

    with open(os.path.join(checkpoint, "config.json")) as f:
        qcfg = json.load(f).get("quantization_config") or {}
    block = qcfg.get("weight_block_size")
    if qcfg.get("quant_method") != "fp8" or not (isinstance(block, list) and len(block) == 2):
        raise ValueError(f"{checkpoint} is not a block-FP8 checkpoint: its quantization_config is {qcfg!r} "
                         "(expected quant_method 'fp8' with a 2-element weight_block_size)")
    dtypes: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                dtypes[k] = f.get_slice(k).get_dtype()
    names = [k for k, dt in dtypes.items() if dt == "F8_E4M3" and k + SCALE_SUFFIX in dtypes]
    if not names:
        raise ValueError(f"{checkpoint} holds no F8_E4M3 weight with a {SCALE_SUFFIX} partner")
    return names, (int(block[0]), int(block[1]))


class BlockFP8Source(WeightSource):
    """``inner``'s weights with each of ``names`` (2-D floating weights) served as block FP8: ``name`` as
    float8_e4m3fn of its shape, ``name + "_scale_inv"`` as float32 ``[ceil(rows/bn), ceil(cols/bm)]``, placed
    right after it in metadata and in its gather group. Every other tensor passes through unchanged."""

    def __init__(self, inner: Any, names: Collection[str], *, block: tuple[int, int] = (BLOCK, BLOCK)):
        self.inner = adapt(inner)
        names = list(names)
        if len(names) > MAX_NAMES:
            raise ValueError(f"BlockFP8Source: {len(names)} names to quantise (at most {MAX_NAMES})")
        self.names = frozenset(names)
        bn, bm = (int(b) for b in block)
        if bn <= 0 or bm <= 0:
            raise ValueError(f"BlockFP8Source: block must be positive, got {tuple(block)}")
        self.block = (bn, bm)
        self._metas: list[ParamMeta] | None = None

    @classmethod
    def for_checkpoint(cls, inner: Any, checkpoint: str) -> "BlockFP8Source":
        """Quantise what the engine's block-FP8 checkpoint stores quantised, with its block."""
        names, block = block_fp8_names(checkpoint)
        return cls(inner, names, block=block)

    @property
    def stats(self) -> dict[str, Any]:
        return dict(getattr(self.inner, "stats", None) or {})

    def metadata(self) -> list[ParamMeta]:
        if self._metas is not None:
            return self._metas
        inner = self.inner.metadata()
        seen = {m.name for m in inner}
        missing = sorted(self.names - seen)
        if missing:
            raise MetadataMismatch(f"BlockFP8Source: {len(missing)} weights to quantise are not in the trainer's "
                                   f"metadata, e.g. {missing[:3]}")
        out: list[ParamMeta] = []
        for m in inner:
            if m.name not in self.names:
                out.append(m)
                continue
            if len(m.shape) != 2 or not getattr(torch, m.dtype).is_floating_point or m.dtype.startswith("float8"):
                raise MetadataMismatch(f"BlockFP8Source: {m.name!r} is {m.dtype}{list(m.shape)}; block FP8 takes a "
                                       "2-D bf16/fp16/fp32 weight")
            if m.name + SCALE_SUFFIX in seen:
                raise MetadataMismatch(f"BlockFP8Source: the trainer already holds {m.name + SCALE_SUFFIX!r}; "
                                       f"{m.name!r} is quantised already")
            rows, cols = m.shape
            out.append(ParamMeta(name=m.name, dtype=dtype_name(torch.float8_e4m3fn), shape=tuple(m.shape)))
            out.append(ParamMeta(name=m.name + SCALE_SUFFIX, dtype="float32",
                                 shape=(-(-rows // self.block[0]), -(-cols // self.block[1]))))
        self._metas = out
        return out

    def _expand(self, names: Collection[str]) -> list[str]:
        out: list[str] = []
        for n in names:
            out.append(n)
            if n in self.names:
                out.append(n + SCALE_SUFFIX)
        return out

    def held_names(self) -> Collection[str] | None:
        held = self.inner.held_names()
        return None if held is None else self._expand(held)

    def groups(self) -> list[list[str]]:
        self.metadata()
        return [self._expand(g) for g in self.inner.groups()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors)

    def iter_groups(self) -> Iterator[Batch]:
        self.metadata()
        for names, tensors in self.inner.iter_groups():
            out_n: list[str] = []
            out_t: list[torch.Tensor | None] = []
            for n, t in zip(names, tensors):
                if n not in self.names:
                    out_n.append(n)
                    out_t.append(t)
                    continue
                q = s = None
                if t is not None:
                    with torch.no_grad():
                        q, s = block_fp8(t.detach(), self.block)
                out_n += [n, n + SCALE_SUFFIX]
                out_t += [q, s]
            yield out_n, out_t
