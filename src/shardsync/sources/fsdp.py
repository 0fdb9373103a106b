"""A :class:`~shardsync.source.WeightSource` over an FSDP2 (``fully_shard``) module: one all-gather per group.

FSDP2 keeps every parameter as a DTensor sharded on dim 0 (``Shard(0)``) over the data-parallel mesh.
``FSDPSource`` materialises a whole gather group (``pre``, one decoder layer, ``post``) with ONE collective:
each rank packs the bytes of its local shards of the group (each padded to ``ceil(dim0 / world)`` rows, as
FSDP2 pads them) into one flat uint8 buffer, ``all_gather_into_tensor`` concatenates the ranks' buffers,
and the full tensors are cut out of the result. Bytes are gathered, so a group may mix dtypes and the result
is bit-exact. Tensors laid out otherwise (TP dims of a 2-D mesh, ``Shard(1)``, ...) fall back to
``DTensor.full_tensor()``; plain tensors are yielded as they are::

    model = Qwen3ForCausalLM(cfg); [fully_shard(l) for l in model.model.layers]; fully_shard(model)
    source = FSDPSource(model)                        # or FSDPSource(model, name_map=my_hf_names)
    metas = source.metadata()                         # global shapes/dtypes; nothing is gathered
    for names, tensors in source.iter_groups(): ...   # every rank, same order (the lockstep contract)

``stats`` counts ``collectives`` issued (one per group and process group, plus one per sharded mesh dim of
each fallback tensor) and
``gathered_bytes`` (bytes of the full tensors materialised on this rank), cumulatively.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import MetadataMismatch
from ..source import Batch, SourceChanged, WeightSource, gather_groups
from ..types import ParamMeta, dtype_name

__all__ = ["FSDPSource", "strip_wrappers", "WRAPPER_PREFIXES"]

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.13
_ALIGN = 16  # byte alignment of each tensor in the packed buffer (any dtype can be viewed at it)


def strip_wrappers(name: str) -> str:
    """``_orig_mod.model._checkpoint_wrapped_module.layers.0.w`` -> ``model.layers.0.w`` (wrapper segments of
    FSDP1, ``torch.compile`` and activation checkpointing removed wherever they occur)."""
    parts = [p + "." for p in name.split(".")]
    return "".join(p for p in parts if p not in WRAPPER_PREFIXES)[:-1]


def _rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _fast_dim(t: torch.Tensor) -> int | None:
    """The mesh dim of a DTensor laid out as ``Shard(0)`` on exactly one mesh dim (``Replicate`` on the
    others, e.g. FSDP or HSDP); None when it needs ``full_tensor()`` (or is not a DTensor)."""
    if not isinstance(t, DTensor) or t.ndim == 0:
        return None
    shard = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    if len(shard) != 1 or t.placements[shard[0]] != Shard(0):
        return None
    if not all(isinstance(p, Replicate) for i, p in enumerate(t.placements) if i != shard[0]):
        return None
    return shard[0]


class FSDPSource(WeightSource):
    """Every rank holds a shard of every tensor, so ``held_names()`` is None and each rank iterates every group.

    ``name_map(name) -> str | None`` renames a (wrapper-stripped) module name to its checkpoint name; None
    leaves the parameter out. Parameters are looked up afresh on each pass (FSDP2 swaps the registered
    parameters between sharded and unsharded); the metadata is computed once.
    """

    def __init__(self, module: nn.Module, *, name_map: Callable[[str], str | None] | None = None):
        self.module = module
        self.name_map = name_map
        self.stats = {"collectives": 0, "gathered_bytes": 0}
        self._metas: list[ParamMeta] | None = None

    # ---- names and metadata -------------------------------------------------------------------------------
    def _named(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for raw, p in self.module.named_parameters():
            name = strip_wrappers(raw)
            if self.name_map is not None:
                name = self.name_map(name)
                if name is None:
                    continue
            if name in out:
                raise MetadataMismatch(f"FSDPSource: parameters {raw!r} and another both map to {name!r} "
                                       f"(rank {_rank()})")
            out[name] = p
        return out

    def metadata(self) -> list[ParamMeta]:
        if self._metas is None:
            named = self._named()
            order = [n for g in gather_groups(list(named)) for n in g]   # the order iteration yields them
            self._metas = [ParamMeta(name=n, dtype=dtype_name(named[n].dtype), shape=tuple(named[n].shape))
                           for n in order]
        return list(self._metas)

    def held_names(self) -> None:
        return None

    # ---- materialisation ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors)

    def iter_groups(self) -> Iterator[Batch]:
        metas = {m.name: m for m in self.metadata()}
        named = self._named()
        for group in self.groups():
            missing = [n for n in group if n not in named]
            if missing:
                m = metas[missing[0]]
                raise SourceChanged(tensor=m.name, rank=_rank(), expected=f"{m.dtype}{list(m.shape)}",
                                    found="no parameter of that name in the module any more", source="FSDPSource")
            params = {n: named[n].detach() for n in group}
            for n, t in params.items():
                m = metas[n]
                if tuple(t.shape) != tuple(m.shape) or dtype_name(t.dtype) != m.dtype:
                    raise SourceChanged(tensor=n, rank=_rank(), expected=f"{m.dtype}{list(m.shape)}",
                                        found=f"{dtype_name(t.dtype)}{list(t.shape)}", source="FSDPSource")
            out: dict[str, torch.Tensor] = {}
            buckets: dict[tuple, list[tuple[str, int]]] = {}
            for n in group:                                   # one bucket per process group: usually one
                d = _fast_dim(params[n])
                if d is not None:
                    ranks = tuple(dist.get_process_group_ranks(params[n].device_mesh.get_group(d)))
                    buckets.setdefault((ranks, params[n].device.type), []).append((n, d))
            for bucket in buckets.values():                   # the same buckets, in the same order, on every rank
                names = [n for n, _ in bucket]
                out.update(self._gather_shard0(names, [params[n] for n in names], bucket[0][1]))
            for n in group:                                   # fallbacks, in metadata order on every rank
                if n in out:
                    continue
                t = params[n]
                if isinstance(t, DTensor):                    # one collective per non-replicated mesh dim
                    out[n] = t.full_tensor()
                    self.stats["collectives"] += sum(not p.is_replicate() for p in t.placements)
                else:
                    out[n] = t
                self.stats["gathered_bytes"] += out[n].numel() * out[n].element_size()
            yield list(group), [out[n] for n in group]

    def _gather_shard0(self, names: list[str], params: list[DTensor], mesh_dim: int) -> dict[str, torch.Tensor]:
        mesh = params[0].device_mesh
        pg = mesh.get_group(mesh_dim)
        world, me = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        layout = []                                           # (name, offset, padded bytes, full bytes)
        off = 0
        for n, p in zip(names, params):
            dim0 = p.shape[0]
            rows = -(-dim0 // world)
            row_bytes = math.prod(p.shape[1:]) * p.dtype.itemsize   # no DTensor indexing: no collective
            local = p.to_local()
            want = max(0, min(rows, dim0 - me * rows))
            if local.shape[0] != want or tuple(local.shape[1:]) != tuple(p.shape[1:]):
                raise MetadataMismatch(f"FSDPSource: tensor {n!r} on rank {_rank()} (mesh rank {me} of {world}) "
                                       f"has a local shard of shape {list(local.shape)}, expected {want} rows "
                                       f"of {list(p.shape)} split as torch.chunk does")
            layout.append((n, off, rows * row_bytes, dim0 * row_bytes))
            off += -(-rows * row_bytes // _ALIGN) * _ALIGN
        device = params[0].to_local().device
        send = torch.zeros(off, dtype=torch.uint8, device=device)
        for (n, o, _, _), p in zip(layout, params):
            local = p.to_local().contiguous().reshape(-1).view(torch.uint8)
            send[o:o + local.numel()].copy_(local)
        recv = torch.empty(world * off, dtype=torch.uint8, device=device)
        _ALL_GATHER(recv, send, group=pg)
        self.stats["collectives"] += 1
        recv = recv.view(world, off)
        out: dict[str, torch.Tensor] = {}
        for (n, o, padded, full), p in zip(layout, params):
            buf = torch.empty(world * padded, dtype=torch.uint8, device=device)
            buf.view(world, padded).copy_(recv[:, o:o + padded])   # rank blocks back to back = padded tensor
            out[n] = buf[:full].view(p.dtype).view(p.shape)
            self.stats["gathered_bytes"] += full
        return out
