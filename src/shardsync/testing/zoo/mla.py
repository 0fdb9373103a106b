"""DeepSeek-V2/V3 and Kimi-K2 (MLA attention, dense first layers, shared + routed experts) for the zoo.

The engine side shards like vLLM's ``DeepseekV2ForCausalLM``: ``q_a_proj`` and ``kv_a_proj_with_mqa``
are stacked into one replicated ``fused_qkv_a_proj`` (``kv_a_proj_with_mqa`` alone, replicated, when
there is no ``q_lora_rank``); ``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` are column parallel,
``o_proj`` row parallel; every norm, the router ``gate`` and its fp32 ``e_score_correction_bias`` are
replicated; the first ``first_k_dense_replace`` layers have a dense gate/up + down MLP; shared experts
are a merged column-parallel gate/up plus a row-parallel down; routed experts are a :class:`FusedMoE`
with an expert map (under EP, experts are not tensor-split). Build it on the meta device for at-scale
planning — nothing is allocated::

    cfg = MLAConfig.from_hf(json.load(open("kimi-k2.json")))
    with torch.device("meta"):
        model = MLAModel(cfg, tp_size=32, tp_rank=3, ep_size=32, ep_rank=3)
    plan = record_plan(metadata=mla_metadata(cfg), load_weights=model.load_weights,
                       params=dict(model.named_parameters()))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

import torch
from torch import nn

from ...types import ParamMeta
from .layers import ColumnParallel, FusedMoE, MergedColumnParallel, Replicated, RowParallel, VocabParallelEmbedding

__all__ = ["MLAConfig", "MLAModel", "mla_metadata"]


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """The fields of a DeepSeek-V2/V3 (Kimi-K2) HF config that decide tensor names and shapes."""

    vocab: int = 256
    hidden: int = 64
    layers: int = 3
    heads: int = 4
    inter: int = 96
    """Dense MLP width (first ``first_dense`` layers)."""
    moe_inter: int = 32
    experts: int = 8
    """Routed experts per MoE layer (0 = every layer dense)."""
    shared_experts: int = 1
    first_dense: int = 1
    """``first_k_dense_replace``."""
    moe_freq: int = 1
    """``moe_layer_freq``."""
    q_lora_rank: int = 24
    """0 = no q compression (``q_proj`` instead of ``q_a_proj``/``q_b_proj``: DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 16
    nope: int = 8
    """``qk_nope_head_dim``."""
    rope: int = 4
    """``qk_rope_head_dim``."""
    v_head: int = 8
    tie: bool = False
    noaux_bias: bool = True
    """``topk_method == "noaux_tc"``: the router has an fp32 ``e_score_correction_bias``."""
    dtype: str = "bfloat16"

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "MLAConfig":
        """From an HF ``config.json`` dict (``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM``)."""
        return cls(vocab=d["vocab_size"], hidden=d["hidden_size"], layers=d["num_hidden_layers"],
                   heads=d["num_attention_heads"], inter=d["intermediate_size"],
                   moe_inter=d.get("moe_intermediate_size") or 0, experts=d.get("n_routed_experts") or 0,
                   shared_experts=d.get("n_shared_experts") or 0, first_dense=d.get("first_k_dense_replace", 0),
                   moe_freq=d.get("moe_layer_freq", 1), q_lora_rank=d.get("q_lora_rank") or 0,
                   kv_lora_rank=d["kv_lora_rank"], nope=d["qk_nope_head_dim"], rope=d["qk_rope_head_dim"],
                   v_head=d["v_head_dim"], tie=bool(d.get("tie_word_embeddings", False)),
                   noaux_bias=d.get("topk_method", "noaux_tc") == "noaux_tc",
                   dtype=d.get("torch_dtype") or d.get("dtype") or "bfloat16")

    @classmethod
    def tiny(cls, **kw) -> "MLAConfig":
        return replace(cls(), **kw)

    def is_moe(self, i: int) -> bool:
        """vLLM's rule for whether decoder layer ``i`` has routed experts."""
        return bool(self.experts) and i >= self.first_dense and i % self.moe_freq == 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def mla_metadata(cfg: MLAConfig) -> list[ParamMeta]:
    """Every checkpoint tensor (HF names, full shapes, checkpoint order) — no data. Multi-token-prediction
    layers (``num_nextn_predict_layers``) are left out: vLLM's main model skips them."""
    out: list[ParamMeta] = []
    dt = cfg.dtype

    def add(name: str, *shape: int, dtype: str = dt) -> None:
        out.append(ParamMeta(name=name, dtype=dtype, shape=tuple(shape)))

    H, qk = cfg.hidden, cfg.nope + cfg.rope
    add("model.embed_tokens.weight", cfg.vocab, H)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", H)
        if cfg.q_lora_rank:
            add(p + "self_attn.q_a_proj.weight", cfg.q_lora_rank, H)
            add(p + "self_attn.q_a_layernorm.weight", cfg.q_lora_rank)
            add(p + "self_attn.q_b_proj.weight", cfg.heads * qk, cfg.q_lora_rank)
        else:
            add(p + "self_attn.q_proj.weight", cfg.heads * qk, H)
        add(p + "self_attn.kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.rope, H)
        add(p + "self_attn.kv_a_layernorm.weight", cfg.kv_lora_rank)
        add(p + "self_attn.kv_b_proj.weight", cfg.heads * (cfg.nope + cfg.v_head), cfg.kv_lora_rank)
        add(p + "self_attn.o_proj.weight", H, cfg.heads * cfg.v_head)
        add(p + "post_attention_layernorm.weight", H)
        if not cfg.is_moe(i):
            add(p + "mlp.gate_proj.weight", cfg.inter, H)
            add(p + "mlp.up_proj.weight", cfg.inter, H)
            add(p + "mlp.down_proj.weight", H, cfg.inter)
            continue
        add(p + "mlp.gate.weight", cfg.experts, H)
        if cfg.noaux_bias:
            add(p + "mlp.gate.e_score_correction_bias", cfg.experts, dtype="float32")
        for e in range(cfg.experts):
            add(p + f"mlp.experts.{e}.gate_proj.weight", cfg.moe_inter, H)
            add(p + f"mlp.experts.{e}.up_proj.weight", cfg.moe_inter, H)
            add(p + f"mlp.experts.{e}.down_proj.weight", H, cfg.moe_inter)
        if cfg.shared_experts:
            si = cfg.moe_inter * cfg.shared_experts
            add(p + "mlp.shared_experts.gate_proj.weight", si, H)
            add(p + "mlp.shared_experts.up_proj.weight", si, H)
            add(p + "mlp.shared_experts.down_proj.weight", H, si)
    add("model.norm.weight", H)
    if not cfg.tie:
        add("lm_head.weight", cfg.vocab, H)
    return out


class _MLAAttention(nn.Module):
    def __init__(self, cfg: MLAConfig, tp: int, rank: int):
        super().__init__()
        dt, H, qk = cfg.torch_dtype, cfg.hidden, cfg.nope + cfg.rope
        kw = dict(tp_size=tp, tp_rank=rank, dtype=dt)
        if cfg.q_lora_rank:  # vLLM: DeepSeekV2FusedQkvAProjLinear, disable_tp=True
            self.fused_qkv_a_proj = MergedColumnParallel(H, (cfg.q_lora_rank, cfg.kv_lora_rank + cfg.rope),
                                                         tp_size=1, tp_rank=0, dtype=dt)
            self.q_a_layernorm = Replicated(cfg.q_lora_rank, dtype=dt)
            self.q_b_proj = ColumnParallel(cfg.q_lora_rank, cfg.heads * qk, **kw)
        else:
            self.kv_a_proj_with_mqa = Replicated(cfg.kv_lora_rank + cfg.rope, H, dtype=dt)
            self.q_proj = ColumnParallel(H, cfg.heads * qk, **kw)
        self.kv_a_layernorm = Replicated(cfg.kv_lora_rank, dtype=dt)
        self.kv_b_proj = ColumnParallel(cfg.kv_lora_rank, cfg.heads * (cfg.nope + cfg.v_head), **kw)
        self.o_proj = RowParallel(cfg.heads * cfg.v_head, H, **kw)


class _MLALayer(nn.Module):
    def __init__(self, cfg: MLAConfig, i: int, tp: int, rank: int, ep: int, ep_rank: int):
        super().__init__()
        dt, H = cfg.torch_dtype, cfg.hidden
        kw = dict(tp_size=tp, tp_rank=rank, dtype=dt)
        self.input_layernorm = Replicated(H, dtype=dt)
        self.post_attention_layernorm = Replicated(H, dtype=dt)
        self.self_attn = _MLAAttention(cfg, tp, rank)
        mlp = nn.Module()
        if cfg.is_moe(i):
            mlp.gate = Replicated(cfg.experts, H, dtype=dt)
            if cfg.noaux_bias:
                mlp.gate.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.experts, dtype=torch.float32),
                                                                requires_grad=False)
            # vLLM: with expert parallelism the experts are whole on their EP rank (expert TP = 1)
            etp, etp_rank = (1, 0) if ep > 1 else (tp, rank)
            mlp.experts = FusedMoE(cfg.experts, H, cfg.moe_inter, tp_size=etp, tp_rank=etp_rank,
                                   ep_size=ep, ep_rank=ep_rank, dtype=dt)
            if cfg.shared_experts:
                si = cfg.moe_inter * cfg.shared_experts
                shared = nn.Module()
                shared.gate_up_proj = MergedColumnParallel(H, (si, si), **kw)
                shared.down_proj = RowParallel(si, H, **kw)
                mlp.shared_experts = shared
        else:
            mlp.gate_up_proj = MergedColumnParallel(H, (cfg.inter, cfg.inter), **kw)
            mlp.down_proj = RowParallel(cfg.inter, H, **kw)
        self.mlp = mlp


_STACKED = {  # checkpoint leaf module -> (engine leaf module, shard id), like vLLM's stacked_params_mapping
    "self_attn.q_a_proj": ("self_attn.fused_qkv_a_proj", 0),
    "self_attn.kv_a_proj_with_mqa": ("self_attn.fused_qkv_a_proj", 1),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj", 0),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj", 1),
}
_EXPERT_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class MLAModel(nn.Module):
    """One TP (and EP) rank of a DeepSeek-V3-style model; ``load_weights`` takes HF-named full tensors."""

    def __init__(self, cfg: MLAConfig, *, tp_size: int = 1, tp_rank: int = 0, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        dt = cfg.torch_dtype
        self.cfg = cfg
        model = nn.Module()
        model.embed_tokens = VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp_size=tp_size, tp_rank=tp_rank, dtype=dt)
        model.layers = nn.ModuleList(_MLALayer(cfg, i, tp_size, tp_rank, ep_size, ep_rank) for i in range(cfg.layers))
        model.norm = Replicated(cfg.hidden, dtype=dt)
        self.model = model
        if not cfg.tie:
            self.lm_head = VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp_size=tp_size, tp_rank=tp_rank, dtype=dt)
        self._mods = dict(self.named_modules())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mods, loaded = self._mods, set()
        for name, w in weights:
            if self.cfg.tie and name == "lm_head.weight":
                continue
            module, _, leaf = name.rpartition(".")
            if ".mlp.experts." in module:  # model.layers.L.mlp.experts.E.gate_proj
                layer, _, rest = module.partition(".mlp.experts.")
                e, _, kind = rest.partition(".")
                moe = mods[layer + ".mlp.experts"]
                shard = _EXPERT_SHARD[kind]
                moe.weight_loader(moe.w2_weight if shard == "w2" else moe.w13_weight, w, int(e), shard)
            elif leaf == "e_score_correction_bias":
                getattr(mods[module], leaf).data.copy_(w)
            else:
                layer, sep, sub = module.partition(".layers.")
                head, _, rel = sub.partition(".") if sep else ("", "", "")
                target = _STACKED.get(rel)
                if target is not None and (self.cfg.q_lora_rank or "fused_qkv_a" not in target[0]):
                    mod = mods[f"{layer}.layers.{head}.{target[0]}"]
                    mod.weight_loader(mod.weight, w, target[1])
                else:
                    mod = mods[module]
                    mod.weight_loader(mod.weight, w)
            loaded.add(name)
        return loaded
