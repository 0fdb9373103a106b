"""Trainer stand-ins: trainer ranks whose weights change every step, for the local cluster's producer processes
and the Ray trainer actors, and :func:`serve` (their producer, local or through Ray's registry).

- ``VersionedSource.make(spec, rank, n)``: the weights of version v are the spec's — ``zoo`` (``hf_state_dict``
  with seed v), ``checkpoint`` (a tiny checkpoint perturbed by v), ``megatron`` (:class:`MegatronRank`), ``fsdp``
  (``fsdp_trainer.FSDPRank``: the FSDP2 reference trainer, really training); a PP share of the layers
  (:func:`pp_share`) or, ``replicated``, everything.
- :class:`MegatronRank`: one rank of a Megatron-style TP x EP x PP trainer (local shards in Megatron layouts, gloo
  TP groups, ``MegatronSource``); :class:`GatherEverywhere`, its naive export (``shardsync bench --mode v1``).

Ranks of a real trainer join its gloo group on first use, after every producer is listening
(:class:`JoinedRank`); ``set_version(v)`` is the training step before sync ``v``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...plan.groups import weight_group
from ..zoo import ZooConfig
from .joined_rank import JoinedRank, join_group, serve  # noqa: F401  (serve: the harness's name for it)

__all__ = ["pp_share", "weights_at", "VersionedSource", "serve", "JoinedRank", "MegatronRank", "GatherEverywhere",
           "megatron_coords", "join_group"]


def pp_share(names: list[str], rank: int, n: int) -> list[str]:
    """Names pipeline stage ``rank`` of ``n`` holds: a contiguous block of layers (+pre on 0, +post on last)."""
    layers = sorted({int(weight_group(x).rsplit(".", 1)[1]) for x in names if weight_group(x) not in ("pre", "post")})
    per = -(-len(layers) // n)
    mine = set(layers[rank * per:(rank + 1) * per])
    out = []
    for x in names:
        g = weight_group(x)
        if (g == "pre" and rank == 0) or (g == "post" and rank == n - 1) or \
                (g not in ("pre", "post") and int(g.rsplit(".", 1)[1]) in mine):
            out.append(x)
    return out


def weights_at(spec: dict):
    """``version -> full HF state dict`` of the trainer (seed = version), the same in every process."""
    if spec["kind"] == "fsdp":  # a real trainer: rank 0 writes what it holds after each step
        from safetensors.torch import load_file

        return lambda v: load_file(os.path.join(spec["dir"], f"v{v}.safetensors"))
    if spec["kind"] in ("zoo", "megatron"):
        from ..zoo import hf_state_dict

        zc = ZooConfig(**spec["cfg"])
        if spec.get("changed"):  # delta sync tests: version v changes a fraction of version 0's elements
            return sparse_steps(hf_state_dict(zc, seed=0), float(spec["changed"]))
        return lambda v: hf_state_dict(zc, seed=v)
    from ...verify.checkpoints import load_checkpoint, perturb

    base = load_checkpoint(spec["path"])
    return lambda v: perturb(base, v)


def sparse_steps(base: dict, fraction: float):
    """``version -> state dict``: version 0 is ``base``; version v > 0 changes about ``fraction`` of each tensor's
    elements (chosen by seed v, the same in every process), so two versions differ in about twice that."""
    import torch

    def at(v: int) -> dict:
        if v == 0:
            return base
        out = {}
        for i, (k, t) in enumerate(base.items()):
            g = torch.Generator().manual_seed(v * 1_000_003 + i)
            mask = torch.rand(t.shape, generator=g) < fraction
            new = t.clone()
            new[mask] = (t[mask].float() * 1.5 + 0.01 * v).to(t.dtype)
            out[k] = new
        return out

    return at


class VersionedSource:
    """Factory for a trainer rank's source whose weights change every step (seed = version)."""

    @staticmethod
    def make(spec: dict, rank: int, n: int, *, replicated: bool = False):
        """Rank ``rank`` of ``n``: a PP share of the layers, or (``replicated``, data-parallel ranks) everything."""
        if spec["kind"] == "megatron":
            return MegatronRank(spec, rank, n)
        if spec["kind"] == "fsdp":
            from .fsdp_trainer import FSDPRank

            return FSDPRank(spec, rank, n)
        from ...source import ModuleSource

        at = weights_at(spec)
        first = at(0)
        names = list(first)

        class Source(ModuleSource):
            def set_version(self, v: int) -> None:
                sd = at(v)
                self._state = {k: sd[k] for k in names}

        return Source(first, held=None if replicated else pp_share(names, rank, n))


def megatron_coords(par: dict, rank: int) -> dict[str, int]:
    """Megatron's rank order for TP x EP x PP (no DP beyond EP): tp fastest, then ep, then pp."""
    tp, ep = par.get("tp", 1), par.get("ep", 1)
    return {"tp_rank": rank % tp, "ep_rank": (rank // tp) % ep, "pp_rank": rank // (tp * ep)}


class MegatronRank(JoinedRank):
    """One rank of a Megatron-style TP x EP x PP trainer (gloo among the producer processes): its local shards
    in Megatron layouts, offered through ``MegatronSource``; ``set_version`` is the training step.
    ``spec["gather"] = "everywhere"``: through :class:`GatherEverywhere` instead (``shardsync bench --mode v1``)."""

    def __init__(self, spec: dict, rank: int, n: int):
        from ...sources.megatron import MegatronConfig, MegatronParallel
        from ...sources.megatron_layout import hf_shapes
        from ...types import ParamMeta

        par = spec["par"]
        tp, ep, pp = par.get("tp", 1), par.get("ep", 1), par.get("pp", 1)
        if tp * ep * pp != n:
            raise ValueError(f"{n} producers cannot hold TP{tp} x EP{ep} x PP{pp}")
        self.spec, self.rank, self.n, self.inner, self.version = spec, rank, n, None, 0
        me = megatron_coords(par, rank)
        self.zc = ZooConfig(**spec["cfg"])
        self.mcfg = MegatronConfig.like(self.zc, dtype=self.zc.ckpt_dtype)
        moe_tp = tp > 1 and self.zc.experts
        self.par = MegatronParallel(tp=tp, pp=pp, ep=ep, etp=tp if moe_tp else 1,
                                    etp_rank=me["tp_rank"] if moe_tp else 0, **me)
        self.metas = [ParamMeta(name=k, dtype=self.mcfg.dtype, shape=s) for k, s in hf_shapes(self.mcfg).items()]

    def _source(self):
        """Joins the trainer's process group on first use (after every rank's producer is listening)."""
        if self.inner is None:
            import torch.distributed as dist

            join_group(self.spec, self.rank, self.n)
            tp = self.par.tp
            groups = {tuple(range(s, s + tp)): dist.new_group(list(range(s, s + tp)))  # same order on every rank
                      for s in range(0, self.n, tp)}
            self.tp_group = next(g for rs, g in groups.items() if self.rank in rs)
            self.set_version(self.version)
        return self.inner

    def set_version(self, v: int) -> None:
        from ...sources.megatron import MegatronSource, hf_to_megatron_shards
        from ..zoo import hf_state_dict

        self.version = v
        if not hasattr(self, "tp_group"):
            self._source()
            return
        local = hf_to_megatron_shards(hf_state_dict(self.zc, seed=v), self.mcfg, self.par)
        if getattr(self, "local", None) is not None:  # an optimizer step: the rank's tensors change IN PLACE
            for k, t in local.items():
                self.local[k].copy_(t)
            return
        self.local = local
        if self.spec.get("gather") == "everywhere":  # bench v1: every tensor on every rank
            self.inner = GatherEverywhere(local, self.mcfg, self.par, self.rank, self.n, self.spec["par"])
            return
        self.inner = MegatronSource(local, self.mcfg, self.par, tp_group=self.tp_group,
                                    etp_group=self.tp_group if self.par.etp > 1 else None)



class GatherEverywhere:
    """The naive trainer-side export (``bench --mode v1``): EVERY rank materialises EVERY tensor of the model,
    tensor by tensor, with one all-gather over the whole trainer world per Megatron tensor (the ranks holding
    its TP/ETP shards put them in, every other rank zeros of the same shape). ``held_names()`` is None: every
    rank holds everything, so routing may pick any rank; the world iterates every group in lockstep."""

    def __init__(self, local: dict, mcfg: Any, par: Any, rank: int, n: int, sizes: dict):
        from ...source import gather_groups
        from ...sources.megatron_layout import hf_shapes, items, local_shapes
        from ...types import ParamMeta, dtype_of

        self.local, self.mcfg, self.rank, self.n, self.dtype = local, mcfg, rank, n, dtype_of(mcfg.dtype)
        self.metas = [ParamMeta(name=k, dtype=mcfg.dtype, shape=s) for k, s in hf_shapes(mcfg).items()]
        plan: dict[tuple, tuple] = {}  # HF names -> (item, {shard index: (rank, local name)}, shard shape)
        for r in range(n):
            c = megatron_coords(sizes, r)
            pr = par.replace(**c, etp_rank=c["tp_rank"] if par.etp > 1 else 0)
            shapes = local_shapes(mcfg, pr)
            for it in items(mcfg, pr):
                split = (it.axis == "tp" and pr.tp > 1) or (it.axis == "etp" and pr.etp > 1)
                if it.export:
                    i = (pr.tp_rank if it.axis == "tp" else pr.etp_rank) if split else 0
                    plan.setdefault(it.hf, (it, {}, shapes[it.local]))[1].setdefault(i, (r, it.local))
        self._groups = gather_groups([m.name for m in self.metas])
        self._plan: dict[str, list[tuple]] = {}
        for key, (it, holders, shape) in plan.items():
            self._plan.setdefault(weight_group(key[0]), []).append((it, [holders[i] for i in sorted(holders)], shape))

    def metadata(self):
        return self.metas

    def held_names(self):
        return None

    def groups(self):
        return [list(g) for g in self._groups]

    def iter_groups(self):
        import torch.distributed as dist

        from ...sources.megatron_layout import merge

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for names in self._groups:
            out: dict[str, torch.Tensor] = {}
            for it, holders, shape in self._plan[weight_group(names[0])]:  # one world collective per tensor
                mine = next((self.local[x].contiguous() for r, x in holders if r == self.rank), None)
                mine = torch.zeros(shape, dtype=self.dtype) if mine is None else mine
                k = mine.numel()
                full = torch.empty(self.n * k, dtype=mine.dtype)
                gather(full, mine.view(-1))
                out.update(zip(it.hf, merge(it, [full[r * k:(r + 1) * k].view(shape) for r, _ in holders], self.mcfg)))
            yield list(names), [out[x] for x in names]
