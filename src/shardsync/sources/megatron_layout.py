"""Megatron-core parameter layouts of a Llama/Qwen-style decoder (dense or MoE), as pure conversions.

No collectives and no Megatron import here: :func:`hf_to_megatron_shards` cuts HF checkpoint tensors into
what one TP·PP·EP(·ETP) rank holds under Megatron's local names, and :func:`megatron_to_hf` puts the TP/ETP
peers' shards back together. :class:`~shardsync.sources.megatron.MegatronSource` uses the same per-tensor
rules (:func:`items`, :func:`shard`, :func:`merge`) after its one all-gather per layer::

    cfg = MegatronConfig(vocab=250, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128)
    par = MegatronParallel(tp=2, pp=2, tp_rank=1, pp_rank=0)
    local = hf_to_megatron_shards(hf_state_dict, cfg, par)      # this rank's Megatron state dict
    peers = [hf_to_megatron_shards(hf_state_dict, cfg, par.replace(tp_rank=r)) for r in range(2)]
    assert megatron_to_hf(cfg, par, peers).keys() == set(held_hf_names(cfg, par))

Layouts (checked against megatron-core 0.14 ``GPTModel`` state dicts and forward passes on CPU/gloo, see
``sources.megatron``; megatron-core itself is not a dependency):

* ``embedding.word_embeddings.weight`` / ``output_layer.weight``: vocab-parallel, the vocab padded (zero rows)
  to a multiple of ``make_vocab_size_divisible_by * tp``, rows split over TP.
* ``decoder.layers.{j}.self_attention.linear_qkv.weight``: per query group ``[q heads of the group; k; v]``,
  the query groups split over TP. ``linear_proj`` and ``linear_fc2`` are row parallel (dim 1 split).
* ``...mlp.linear_fc1.weight``: gate and up each split over TP, local ``[gate_r; up_r]``.
* Norms, q/k layernorms and the MoE router are replicated. Experts: EP rank ``r`` holds experts
  ``r*E/ep + k`` as ``...mlp.experts.local_experts.{k}``, fc1/fc2 split over ETP like the dense ones.
* ``{j}`` is the stage-local layer index, as in ``model.state_dict()`` of one PP stage.
* ``fused_norms=True`` (Transformer-Engine spec): input layernorm is ``linear_qkv.layer_norm_weight``, the
  dense post-attention layernorm ``linear_fc1.layer_norm_weight`` (MoE: ``pre_mlp_layernorm.weight``);
  ``False`` (megatron-core's local spec): ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``.
* Tied embeddings: HF has no ``lm_head.weight``; Megatron's last stage (pp > 1) keeps a copy of the
  embedding as ``output_layer.weight``, produced here but never exported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

__all__ = ["MegatronConfig", "MegatronParallel", "Item", "hf_shapes", "items", "held_hf_names",
           "local_shapes", "shard", "merge", "hf_to_megatron_shards", "megatron_to_hf", "padded_vocab"]


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """Model shape (field names as ``zoo.ZooConfig``; ``like(zoo_cfg)`` copies them)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int = 0
    experts: int = 0
    """0 = dense MLP in every layer; otherwise every layer is MoE (Qwen3-MoE)."""
    moe_inter: int = 0
    qk_norm: bool = False
    tie: bool = False
    dtype: str = "bfloat16"
    make_vocab_size_divisible_by: int = 128
    fused_norms: bool = True
    """Transformer-Engine spec names (layernorm fused into linear_qkv / linear_fc1) vs the local spec."""

    _SHAPE_FIELDS = ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "inter", "experts",
                     "moe_inter", "qk_norm", "tie")

    @classmethod
    def like(cls, other: Any, **overrides: Any) -> "MegatronConfig":
        """A config with the shape fields of any object spelling them the same way (``zoo.ZooConfig``)."""
        kw = {f: getattr(other, f) for f in cls._SHAPE_FIELDS if hasattr(other, f)}
        kw.update(overrides)
        return cls(**kw)


@dataclass(frozen=True, kw_only=True)
class MegatronParallel:
    """Parallel sizes and this rank's coordinates. PP stage ``s`` holds decoder layers
    ``stage_layers(n, s)``: ``layers_per_stage`` an int (every stage), a tuple (one count per stage) or
    None (an even split)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    layers_per_stage: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for size, rank in (("tp", "tp_rank"), ("pp", "pp_rank"), ("ep", "ep_rank"), ("etp", "etp_rank")):
            s, r = getattr(self, size), getattr(self, rank)
            if s < 1 or not 0 <= r < s:
                raise ValueError(f"MegatronParallel: {rank}={r} is not in [0, {size}={s})")
        if isinstance(self.layers_per_stage, tuple) and len(self.layers_per_stage) != self.pp:
            raise ValueError(f"MegatronParallel: layers_per_stage has {len(self.layers_per_stage)} entries for "
                             f"pp={self.pp}")

    def replace(self, **kw: Any) -> "MegatronParallel":
        return dataclasses.replace(self, **kw)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_layers(self, num_layers: int, pp_rank: int | None = None) -> range:
        """The global decoder layers of PP stage ``pp_rank`` (this rank's by default)."""
        s = self.pp_rank if pp_rank is None else pp_rank
        lps = self.layers_per_stage
        if lps is None:
            if num_layers % self.pp:
                raise ValueError(f"{num_layers} layers do not split evenly over pp={self.pp}; "
                                 "give layers_per_stage")
            lps = num_layers // self.pp
        counts = (lps,) * self.pp if isinstance(lps, int) else tuple(lps)
        if sum(counts) != num_layers:
            raise ValueError(f"layers_per_stage {counts} covers {sum(counts)} layers, the model has {num_layers}")
        start = sum(counts[:s])
        return range(start, start + counts[s])

    def where(self) -> str:
        """This rank, for error messages."""
        g = ""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            g = f"rank {torch.distributed.get_rank()} "
        return f"{g}(tp {self.tp_rank}/{self.tp}, pp {self.pp_rank}/{self.pp}, ep {self.ep_rank}/{self.ep}, " \
               f"etp {self.etp_rank}/{self.etp})"

    def check(self, cfg: MegatronConfig) -> None:
        """ValueError unless ``cfg`` splits over these sizes the way Megatron requires."""
        bad = []
        if cfg.heads % cfg.kv_heads:
            bad.append(f"heads={cfg.heads} % kv_heads={cfg.kv_heads}")
        if cfg.kv_heads % self.tp:
            bad.append(f"kv_heads={cfg.kv_heads} % tp={self.tp}")
        if not cfg.experts and cfg.inter % self.tp:
            bad.append(f"inter={cfg.inter} % tp={self.tp}")
        if cfg.experts and cfg.experts % self.ep:
            bad.append(f"experts={cfg.experts} % ep={self.ep}")
        if cfg.experts and cfg.moe_inter % self.etp:
            bad.append(f"moe_inter={cfg.moe_inter} % etp={self.etp}")
        if bad:
            raise ValueError(f"Megatron layout does not divide: {', '.join(bad)}")
        self.stage_layers(cfg.layers)


@dataclass(frozen=True)
class Item:
    """One Megatron local tensor: its name, how it is cut (``rep``, ``vocab``, ``row``, ``qkv``, ``fc1``),
    the HF tensors it covers (HF order), the axis it is split over (``tp``, ``etp`` or None) and whether it is
    exported (False: the last stage's copy of a tied embedding)."""

    local: str
    kind: str
    hf: tuple[str, ...]
    axis: str | None
    export: bool = True


def padded_vocab(cfg: MegatronConfig, tp: int) -> int:
    m = cfg.make_vocab_size_divisible_by * tp
    return -(-cfg.vocab // m) * m


def hf_shapes(cfg: MegatronConfig) -> dict[str, tuple[int, ...]]:
    """HF (Qwen3 / Qwen3-MoE) names and full shapes of the whole model, in checkpoint order."""
    H, hd, out = cfg.hidden, cfg.head_dim, {}
    out["model.embed_tokens.weight"] = (cfg.vocab, H)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "self_attn.q_proj.weight"] = (cfg.heads * hd, H)
        out[p + "self_attn.k_proj.weight"] = (cfg.kv_heads * hd, H)
        out[p + "self_attn.v_proj.weight"] = (cfg.kv_heads * hd, H)
        out[p + "self_attn.o_proj.weight"] = (H, cfg.heads * hd)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if not cfg.experts:
            out[p + "mlp.gate_proj.weight"] = (cfg.inter, H)
            out[p + "mlp.up_proj.weight"] = (cfg.inter, H)
            out[p + "mlp.down_proj.weight"] = (H, cfg.inter)
        else:
            out[p + "mlp.gate.weight"] = (cfg.experts, H)
            for e in range(cfg.experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (cfg.moe_inter, H)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (cfg.moe_inter, H)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (H, cfg.moe_inter)
    out["model.norm.weight"] = (H,)
    if not cfg.tie:
        out["lm_head.weight"] = (cfg.vocab, H)
    return out


def items(cfg: MegatronConfig, par: MegatronParallel) -> list[Item]:
    """The Megatron local tensors of rank ``par``, in HF order (``pre``, layers, ``post``)."""
    par.check(cfg)
    out: list[Item] = []
    if par.first_stage:
        out.append(Item("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",), "tp"))
    for j, i in enumerate(par.stage_layers(cfg.layers)):
        m, h = f"decoder.layers.{j}.", f"model.layers.{i}."
        a, sa = m + "self_attention.", h + "self_attn."
        ln_in = a + "linear_qkv.layer_norm_weight" if cfg.fused_norms else m + "input_layernorm.weight"
        out.append(Item(ln_in, "rep", (h + "input_layernorm.weight",), None))
        out.append(Item(a + "linear_qkv.weight", "qkv", (sa + "q_proj.weight", sa + "k_proj.weight",
                                                         sa + "v_proj.weight"), "tp"))
        out.append(Item(a + "linear_proj.weight", "row", (sa + "o_proj.weight",), "tp"))
        if cfg.qk_norm:
            out.append(Item(a + "q_layernorm.weight", "rep", (sa + "q_norm.weight",), None))
            out.append(Item(a + "k_layernorm.weight", "rep", (sa + "k_norm.weight",), None))
        ln_post = (m + "mlp.linear_fc1.layer_norm_weight" if cfg.fused_norms and not cfg.experts
                   else m + "pre_mlp_layernorm.weight")
        out.append(Item(ln_post, "rep", (h + "post_attention_layernorm.weight",), None))
        if not cfg.experts:
            out.append(Item(m + "mlp.linear_fc1.weight", "fc1", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                            "tp"))
            out.append(Item(m + "mlp.linear_fc2.weight", "row", (h + "mlp.down_proj.weight",), "tp"))
            continue
        out.append(Item(m + "mlp.router.weight", "rep", (h + "mlp.gate.weight",), None))
        n_local = cfg.experts // par.ep
        for k in range(n_local):
            e, x = par.ep_rank * n_local + k, f"{m}mlp.experts.local_experts.{k}."
            he = f"{h}mlp.experts.{e}."
            out.append(Item(x + "linear_fc1.weight", "fc1", (he + "gate_proj.weight", he + "up_proj.weight"), "etp"))
            out.append(Item(x + "linear_fc2.weight", "row", (he + "down_proj.weight",), "etp"))
    if par.last_stage:
        out.append(Item("decoder.final_layernorm.weight", "rep", ("model.norm.weight",), None))
        if not cfg.tie:
            out.append(Item("output_layer.weight", "vocab", ("lm_head.weight",), "tp"))
        elif par.pp > 1:
            out.append(Item("output_layer.weight", "vocab", ("model.embed_tokens.weight",), "tp", export=False))
    return out


def held_hf_names(cfg: MegatronConfig, par: MegatronParallel) -> list[str]:
    """The HF names rank ``par`` holds (its PP stage, its EP rank's experts), in HF order."""
    return [n for it in items(cfg, par) if it.export for n in it.hf]


def _split(par: MegatronParallel, axis: str | None) -> tuple[int, int]:
    if axis == "tp":
        return par.tp_rank, par.tp
    if axis == "etp":
        return par.etp_rank, par.etp
    return 0, 1


def shard(item: Item, hf: Sequence[torch.Tensor], cfg: MegatronConfig, par: MegatronParallel) -> torch.Tensor:
    """The local tensor of ``item`` on rank ``par`` from the full HF tensors ``hf`` (``item.hf`` order)."""
    rank, size = _split(par, item.axis)
    if item.kind == "rep":
        return hf[0]
    if item.kind == "vocab":
        t = hf[0]
        t = F.pad(t, (0, 0, 0, padded_vocab(cfg, par.tp) - t.shape[0]))
        return t.chunk(size, 0)[rank]
    if item.kind == "row":
        return hf[0].chunk(size, 1)[rank]
    if item.kind == "fc1":
        return torch.cat([hf[0].chunk(size, 0)[rank], hf[1].chunk(size, 0)[rank]])
    if item.kind == "qkv":
        q, k, v = hf
        ng, hd, H = cfg.kv_heads, cfg.head_dim, q.shape[-1]
        fused = torch.cat([q.reshape(ng, -1, hd, H), k.reshape(ng, 1, hd, H), v.reshape(ng, 1, hd, H)], 1)
        return fused.chunk(size, 0)[rank].reshape(-1, H)
    raise ValueError(f"unknown layout kind {item.kind!r} of {item.local!r}")


def merge(item: Item, peers: Sequence[torch.Tensor], cfg: MegatronConfig) -> list[torch.Tensor]:
    """The full HF tensors of ``item`` (``item.hf`` order) from the local tensors of all its peers (rank
    order over ``item.axis``; one tensor for a replicated item)."""
    if item.kind == "rep":
        return [peers[0]]
    if item.kind == "vocab":
        return [torch.cat(list(peers), 0)[: cfg.vocab]]
    if item.kind == "row":
        return [torch.cat(list(peers), 1)]
    if item.kind == "fc1":
        halves = [p.chunk(2, 0) for p in peers]
        return [torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])]
    if item.kind == "qkv":
        ng, hd, H = cfg.kv_heads, cfg.head_dim, peers[0].shape[-1]
        qpg = cfg.heads // ng
        fused = torch.cat([p.reshape(-1, qpg + 2, hd, H) for p in peers], 0)
        if fused.shape[0] != ng:
            raise ValueError(f"{item.local}: {fused.shape[0]} query groups gathered, the model has {ng}")
        return [fused[:, :qpg].reshape(-1, H), fused[:, qpg].reshape(-1, H), fused[:, qpg + 1].reshape(-1, H)]
    raise ValueError(f"unknown layout kind {item.kind!r} of {item.local!r}")


def local_shapes(cfg: MegatronConfig, par: MegatronParallel) -> dict[str, tuple[int, ...]]:
    """Megatron local names and shapes of rank ``par`` (no data: computed on meta tensors)."""
    shapes = hf_shapes(cfg)
    metas = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    return {it.local: tuple(shard(it, [metas[n] for n in it.hf], cfg, par).shape) for it in items(cfg, par)}


def hf_to_megatron_shards(hf_state_dict: Mapping[str, torch.Tensor], cfg: MegatronConfig,
                          par: MegatronParallel) -> dict[str, torch.Tensor]:
    """What rank ``par`` holds, under Megatron local names (fresh contiguous tensors)."""
    out = {}
    for it in items(cfg, par):
        missing = [n for n in it.hf if n not in hf_state_dict]
        if missing:
            raise KeyError(f"hf_to_megatron_shards: {missing} missing from the HF state dict (for {it.local!r} "
                           f"on {par.where()})")
        out[it.local] = shard(it, [hf_state_dict[n] for n in it.hf], cfg, par).contiguous().clone()
    return out


def megatron_to_hf(cfg: MegatronConfig, par: MegatronParallel, tp_peers: Sequence[Mapping[str, torch.Tensor]],
                   etp_peers: Sequence[Mapping[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """The HF tensors rank ``par`` holds, from the local state dicts of its TP peers (``tp_peers[r]`` = TP rank
    ``r``, this rank included) and, for experts under ETP, its ETP peers (default: none, etp must be 1).
    The in-process counterpart of ``MegatronSource.iter_groups``."""
    if len(tp_peers) != par.tp:
        raise ValueError(f"megatron_to_hf: {len(tp_peers)} TP peers for tp={par.tp}")
    if etp_peers is None:
        if par.etp != 1:
            raise ValueError("megatron_to_hf: etp > 1 needs etp_peers")
        etp_peers = [tp_peers[par.tp_rank]]
    out: dict[str, torch.Tensor] = {}
    for it in items(cfg, par):
        if not it.export:
            continue
        peers = {"tp": tp_peers, "etp": etp_peers, None: [tp_peers[par.tp_rank]]}[it.axis]
        for n, t in zip(it.hf, merge(it, [p[it.local] for p in peers], cfg)):
            out[n] = t
    return out
