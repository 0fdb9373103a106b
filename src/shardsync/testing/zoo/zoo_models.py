"""Tiny decoder-only models assembled from the zoo layers, with HF checkpoint names.

``ZooConfig`` picks the checkpoint layout: separate or fused q/k/v and gate/up (Llama vs Phi-3),
dense or MoE MLPs with per-expert or fused transposed expert tensors (Qwen3-MoE / Mixtral vs Llama-4),
tied embeddings, and a checkpoint dtype that may differ from the engine's (dtype-converting copies).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable

import torch
from torch import nn

from .layers import FusedMoE, MergedColumnParallel, QKVParallel, Replicated, RowParallel, VocabParallelEmbedding


@dataclass(frozen=True, kw_only=True)
class ZooConfig:
    vocab: int = 250
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    inter: int = 128
    experts: int = 0
    """0 = dense MLP."""
    moe_inter: int = 32
    moe_layout: str = "per_expert"
    """``per_expert`` (Qwen3-MoE, ``experts.N.gate_proj``), ``mixtral`` (``block_sparse_moe.experts.N.w1``)
    or ``fused_t`` (Llama-4, ``experts.gate_up_proj`` [E, H, 2I])."""
    fused_qkv: bool = False
    fused_gate_up: bool = False
    qk_norm: bool = False
    tie: bool = False
    dtype: str = "bfloat16"
    """Engine parameter dtype."""
    ckpt_dtype: str = "bfloat16"
    """Checkpoint dtype (differs -> dtype-converting copies)."""

    @classmethod
    def qwen3_moe_tiny(cls, **kw) -> "ZooConfig":
        return replace(cls(experts=8, qk_norm=True, heads=4, kv_heads=2), **kw)

    @classmethod
    def llama_tiny(cls, **kw) -> "ZooConfig":
        return replace(cls(), **kw)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def hf_shapes(cfg: ZooConfig) -> dict[str, tuple[int, ...]]:
    """HF checkpoint names and full shapes for ``cfg``, in checkpoint order (no data)."""
    out: dict[str, tuple[int, ...]] = {}

    def add(name: str, *shape: int) -> None:
        out[name] = shape

    H, hd = cfg.hidden, cfg.head_dim
    add("model.embed_tokens.weight", cfg.vocab, H)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", H)
        if cfg.fused_qkv:
            add(p + "self_attn.qkv_proj.weight", (cfg.heads + 2 * cfg.kv_heads) * hd, H)
        else:
            add(p + "self_attn.q_proj.weight", cfg.heads * hd, H)
            add(p + "self_attn.k_proj.weight", cfg.kv_heads * hd, H)
            add(p + "self_attn.v_proj.weight", cfg.kv_heads * hd, H)
        add(p + "self_attn.o_proj.weight", H, cfg.heads * hd)
        if cfg.qk_norm:
            add(p + "self_attn.q_norm.weight", hd)
            add(p + "self_attn.k_norm.weight", hd)
        add(p + "post_attention_layernorm.weight", H)
        E, I = cfg.experts, cfg.moe_inter
        if not E:
            if cfg.fused_gate_up:
                add(p + "mlp.gate_up_proj.weight", 2 * cfg.inter, H)
            else:
                add(p + "mlp.gate_proj.weight", cfg.inter, H)
                add(p + "mlp.up_proj.weight", cfg.inter, H)
            add(p + "mlp.down_proj.weight", H, cfg.inter)
        elif cfg.moe_layout == "fused_t":
            add(p + "feed_forward.router.weight", E, H)
            add(p + "feed_forward.experts.gate_up_proj", E, H, 2 * I)
            add(p + "feed_forward.experts.down_proj", E, I, H)
        elif cfg.moe_layout == "mixtral":
            add(p + "block_sparse_moe.gate.weight", E, H)
            for e in range(E):
                add(p + f"block_sparse_moe.experts.{e}.w1.weight", I, H)
                add(p + f"block_sparse_moe.experts.{e}.w2.weight", H, I)
                add(p + f"block_sparse_moe.experts.{e}.w3.weight", I, H)
        else:
            add(p + "mlp.gate.weight", E, H)
            for e in range(E):
                add(p + f"mlp.experts.{e}.gate_proj.weight", I, H)
                add(p + f"mlp.experts.{e}.up_proj.weight", I, H)
                add(p + f"mlp.experts.{e}.down_proj.weight", H, I)
    add("model.norm.weight", H)
    if not cfg.tie:
        add("lm_head.weight", cfg.vocab, H)
    return out


def hf_state_dict(cfg: ZooConfig, *, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random (never zero) full tensors with HF checkpoint names for ``cfg``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, cfg.ckpt_dtype)
    return {name: (torch.randn(*shape, generator=g) * 0.5 + 0.01).to(dt).to(device)
            for name, shape in hf_shapes(cfg).items()}


class _Layer(nn.Module):
    def __init__(self, cfg: ZooConfig, tp: int, rank: int, ep: int, ep_rank: int):
        super().__init__()
        dt, H, hd = cfg.torch_dtype, cfg.hidden, cfg.head_dim
        kw = dict(tp_size=tp, tp_rank=rank, dtype=dt)
        self.input_layernorm = Replicated(H, dtype=dt)
        self.post_attention_layernorm = Replicated(H, dtype=dt)
        attn = nn.Module()
        attn.qkv_proj = QKVParallel(H, hd, cfg.heads, cfg.kv_heads, **kw)
        attn.o_proj = RowParallel(cfg.heads * hd, H, **kw)
        if cfg.qk_norm:
            attn.q_norm = Replicated(hd, dtype=dt)
            attn.k_norm = Replicated(hd, dtype=dt)
        self.self_attn = attn
        mlp = nn.Module()
        if cfg.experts:
            mlp.gate = Replicated(cfg.experts, H, dtype=dt)
            mlp.experts = FusedMoE(cfg.experts, H, cfg.moe_inter, ep_size=ep, ep_rank=ep_rank, **kw)
        else:
            mlp.gate_up_proj = MergedColumnParallel(H, (cfg.inter, cfg.inter), **kw)
            mlp.down_proj = RowParallel(cfg.inter, H, **kw)
        self.mlp = mlp


class ZooModel(nn.Module):
    """One TP (and EP) rank of a zoo model; ``load_weights`` takes HF-named full tensors."""

    _STACKED = (  # (engine module suffix, checkpoint suffix, shard id) like vLLM's stacked_params_mapping
        ("self_attn.qkv_proj", "self_attn.q_proj", "q"), ("self_attn.qkv_proj", "self_attn.k_proj", "k"),
        ("self_attn.qkv_proj", "self_attn.v_proj", "v"), ("mlp.gate_up_proj", "mlp.gate_proj", 0),
        ("mlp.gate_up_proj", "mlp.up_proj", 1),
    )
    _EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
    _EXPERT_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}

    def __init__(self, cfg: ZooConfig, *, tp_size: int = 1, tp_rank: int = 0, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        dt = cfg.torch_dtype
        self.cfg = cfg
        model = nn.Module()
        model.embed_tokens = VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp_size=tp_size, tp_rank=tp_rank, dtype=dt)
        model.layers = nn.ModuleList(_Layer(cfg, tp_size, tp_rank, ep_size, ep_rank) for _ in range(cfg.layers))
        model.norm = Replicated(cfg.hidden, dtype=dt)
        self.model = model
        if not cfg.tie:
            self.lm_head = VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp_size=tp_size, tp_rank=tp_rank, dtype=dt)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mods = self.__dict__.get("_mods")
        if mods is None:  # cached: baselines call this once per tensor
            mods = self.__dict__["_mods"] = dict(self.named_modules())
        loaded: set[str] = set()
        for name, w in weights:
            if self.cfg.tie and name == "lm_head.weight":
                continue
            m = self._EXPERT.match(name)
            if m:
                moe = mods[m.group(1) + ".mlp.experts"]
                shard = self._EXPERT_SHARD[m.group(3)]
                param = moe.w2_weight if shard == "w2" else moe.w13_weight
                moe.weight_loader(param, w, int(m.group(2)), shard)
                loaded.add(name)
                continue
            if ".feed_forward." in name:  # Llama-4 style fused experts and router
                layer = name.split(".feed_forward.")[0]
                if name.endswith("router.weight"):
                    mods[layer + ".mlp.gate"].weight_loader(mods[layer + ".mlp.gate"].weight, w)
                else:
                    moe = mods[layer + ".mlp.experts"]
                    kind = "gate_up" if name.endswith("gate_up_proj") else "down"
                    moe.load_fused(moe.w13_weight if kind == "gate_up" else moe.w2_weight, w, kind)
                loaded.add(name)
                continue
            name = name.replace("block_sparse_moe.gate", "mlp.gate")
            for engine, ckpt, shard in self._STACKED:
                if ckpt + "." in name:
                    mod = mods[name.replace(ckpt, engine).removesuffix(".weight")]
                    mod.weight_loader(mod.weight, w, shard)
                    break
            else:
                mod = mods[name.removesuffix(".weight")]
                mod.weight_loader(mod.weight, w)
            loaded.add(name)
        return loaded
