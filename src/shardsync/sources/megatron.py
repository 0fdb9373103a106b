"""A weight source over one Megatron-core TP·PP·EP(·ETP) rank: :class:`MegatronSource`.

The rank's local state dict (Megatron names and layouts, ``sources.megatron_layout``) is offered as the whole
model in HF checkpoint names (Qwen3 / Qwen3-MoE). Per gather group (``pre``, one per decoder layer of this PP
stage, ``post``) it runs ONE all-gather of every TP-split tensor of the group, flattened into one byte buffer
over the TP group (expert tensors over the ETP group when etp > 1, in the same collective when that group
is the TP group), then converts to HF layouts: QKV un-interleaved into q/k/v, fc1 split into gate/up, vocab
padding stripped. Nothing ever moves across PP or EP: a stage offers its own layers, an EP rank its own
experts (``held_names``), and other ranks' names in a held group are ``None``::

    cfg = MegatronConfig(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                         inter=12288, qk_norm=True)
    par = MegatronParallel(tp=4, pp=2, tp_rank=tp_rank, pp_rank=pp_rank)
    source = MegatronSource(model.state_dict(), cfg, par, tp_group=tp_group)
    # or, inside a Megatron job: MegatronSource.from_megatron(model, cfg)
    for names, tensors in source.iter_groups(): ...     # lockstep over the TP group

``source.stats`` counts collectives and the bytes of full HF tensors materialised on this rank.

Layouts were checked against megatron-core 0.14 (its local spec, ``transformer_impl='local'``) on CPU/gloo:
``hf_to_megatron_shards`` loads strictly into a real ``GPTModel`` (TP2 dense with q/k norm, EP2 MoE) whose
logits equal HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` to 4e-8 (fp32). megatron-core is not a
dependency and the tests use the in-repo reference layout; the Transformer-Engine names
(``fused_norms=True``) follow Megatron's TE spec and were not run against TE.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import MetadataMismatch
from ..plan.groups import weight_group
from ..source import Batch, LiveTensors, WeightSource, _dist_rank
from ..types import ParamMeta, dtype_name
from .megatron_layout import (Item, MegatronConfig, MegatronParallel, hf_shapes, hf_to_megatron_shards, items,
                              local_shapes, megatron_to_hf, merge)

__all__ = ["MegatronSource", "MegatronConfig", "MegatronParallel", "hf_to_megatron_shards", "megatron_to_hf"]

_ALIGN = 16
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class MegatronSource(WeightSource):
    """The weights of one Megatron rank, offered in HF names. ``local_state``: the rank's (model chunk's)
    ``state_dict()`` or the module; ``tp_group`` / ``etp_group``: its tensor- and expert-tensor-parallel
    process groups (ignored at size 1)."""

    def __init__(self, local_state: nn.Module | Mapping[str, torch.Tensor], cfg: MegatronConfig,
                 par: MegatronParallel, *, tp_group: Any, etp_group: Any = None):
        par.check(cfg)
        self.cfg, self.par = cfg, par
        module = local_state if isinstance(local_state, nn.Module) else None
        state = local_state.state_dict() if module is not None else local_state
        self._local = self._validate(state)
        # the local tensors are looked up by name again at every pass (a swapped parameter is served as it is now;
        # one gone or of another shape or dtype is a SourceChanged): ``source.LiveTensors``
        self._state = None if module is not None else local_state
        self._live = LiveTensors(module, [list(self._local)],
                                 {n: (t.dtype, tuple(t.shape)) for n, t in self._local.items()},
                                 rank=_dist_rank(), what=f"MegatronSource on {par.where()}")
        self.tp_group, self.etp_group = tp_group, etp_group
        self._check_group("tp", par.tp, par.tp_rank, tp_group)
        if cfg.experts:  # a dense model ignores ep/etp (Megatron reports etp = tp when it is not set)
            self._check_group("etp", par.etp, par.etp_rank, etp_group)
        # one collective per group when the expert tensor-parallel group is the tensor-parallel group
        self._merged = par.etp > 1 and etp_group is tp_group
        self._items: dict[str, list[Item]] = defaultdict(list)
        for it in items(cfg, par):
            if it.export:
                self._items[weight_group(it.hf[0])].append(it)
        self._shapes = hf_shapes(cfg)
        self._held = frozenset(n for its in self._items.values() for it in its for n in it.hf)
        self._metas = [ParamMeta(name=n, dtype=cfg.dtype, shape=s) for n, s in self._shapes.items()]
        self.stats = {"collectives": 0, "gathered_bytes": 0}

    @classmethod
    def from_megatron(cls, model: nn.Module | Mapping[str, torch.Tensor], cfg: MegatronConfig, *,
                      layers_per_stage: int | tuple[int, ...] | None = None) -> "MegatronSource":
        """Sizes, ranks and groups from ``megatron.core.parallel_state`` (imported here, lazily)."""
        from megatron.core import parallel_state as ps  # noqa: PLC0415 - optional, only inside Megatron jobs

        par = MegatronParallel(
            tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
            etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
            layers_per_stage=layers_per_stage)
        tp_group = ps.get_tensor_model_parallel_group()
        etp_group = ps.get_expert_tensor_parallel_group() if par.etp > 1 and cfg.experts else None
        if etp_group is not None and par.etp == par.tp and sorted(dist.get_process_group_ranks(etp_group)) == \
                sorted(dist.get_process_group_ranks(tp_group)):
            etp_group = tp_group
        return cls(model, cfg, par, tp_group=tp_group, etp_group=etp_group)

    def _validate(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        want, where = local_shapes(self.cfg, self.par), self.par.where()
        optional = {it.local for it in items(self.cfg, self.par) if not it.export}
        unknown = sorted(n for n in state if n not in want and not n.endswith("_extra_state"))
        if unknown:
            raise MetadataMismatch(f"MegatronSource on {where}: local tensors {unknown[:5]} ({len(unknown)}) are not "
                                   "in the Megatron layout of this config and rank")
        out = {}
        for name, shape in want.items():
            t = state.get(name)
            if t is None:
                if name in optional:
                    continue
                raise MetadataMismatch(f"MegatronSource on {where}: local tensor {name!r} is missing "
                                       f"(expected {self.cfg.dtype}{list(shape)})")
            if tuple(t.shape) != shape or dtype_name(t.dtype) != self.cfg.dtype:
                raise MetadataMismatch(f"MegatronSource on {where}: local tensor {name!r} is "
                                       f"{dtype_name(t.dtype)}{list(t.shape)}, expected {self.cfg.dtype}{list(shape)}")
            out[name] = t.detach()
        return out

    def _check_group(self, axis: str, size: int, rank: int, group: Any) -> None:
        if size == 1:
            return
        if group is None:
            raise ValueError(f"MegatronSource on {self.par.where()}: {axis}={size} needs {axis}_group")
        if dist.get_world_size(group) != size or dist.get_rank(group) != rank:
            raise ValueError(f"MegatronSource on {self.par.where()}: {axis}_group has size "
                             f"{dist.get_world_size(group)} and this rank is {dist.get_rank(group)} in it; "
                             f"expected {axis}={size}, {axis}_rank={rank}")

    # -- WeightSource -------------------------------------------------------------------------------------------
    def metadata(self) -> list[ParamMeta]:
        return list(self._metas)

    def held_names(self) -> Collection[str]:
        return self._held

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors)

    def iter_groups(self) -> Iterator[Batch]:
        par = self.par
        self._local = dict(zip(self._live.batches[0].names, self._live.current(self._state)[0]))  # as they are now
        for names in self.groups():
            its = self._items[weight_group(names[0])]
            tp_its = [it for it in its if it.axis == "tp" and par.tp > 1]
            etp_its = [it for it in its if it.axis == "etp" and par.etp > 1]
            peers: dict[str, list[torch.Tensor]] = {}
            if self._merged:
                peers.update(self._gather(tp_its + etp_its, self.tp_group, par.tp))
            else:
                peers.update(self._gather(tp_its, self.tp_group, par.tp))
                peers.update(self._gather(etp_its, self.etp_group, par.etp))
            out: dict[str, torch.Tensor] = {}
            for it in its:
                got = merge(it, peers.get(it.local) or [self._local[it.local]], self.cfg)
                for n, t in zip(it.hf, got):
                    if tuple(t.shape) != self._shapes[n]:
                        raise MetadataMismatch(f"MegatronSource on {par.where()}: {n!r} (from {it.local!r}) came out "
                                               f"{list(t.shape)}, expected {list(self._shapes[n])}")
                    out[n] = t
            self.stats["gathered_bytes"] += sum(t.numel() * t.element_size() for t in out.values())
            yield list(names), [out.get(n) for n in names]

    def _gather(self, its: Sequence[Item], group: Any, size: int) -> dict[str, list[torch.Tensor]]:
        """One all-gather of the local tensors of ``its`` over ``group``, as one aligned byte buffer; the
        peers' tensors (rank order) by local name."""
        if not its:
            return {}
        ts = [self._local[it.local] for it in its]
        offs, total = [], 0
        for t in ts:
            offs.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        buf = torch.empty(total, dtype=torch.uint8, device=ts[0].device)
        for t, o in zip(ts, offs):
            buf[o:o + t.numel() * t.element_size()].copy_(t.contiguous().view(-1).view(torch.uint8))
        full = torch.empty(size * total, dtype=torch.uint8, device=buf.device)
        _gather_single(full, buf, group=group)
        self.stats["collectives"] += 1
        out = {}
        for it, t, o in zip(its, ts, offs):
            nb = t.numel() * t.element_size()
            out[it.local] = [full[r * total + o:r * total + o + nb].view(t.dtype).view(t.shape) for r in range(size)]
        return out
