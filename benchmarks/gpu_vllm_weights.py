"""The weights ``benchmarks/gpu_vllm.py`` syncs: its models' checkpoints and each version's deterministic state."""

from __future__ import annotations

import os

MODELS = {
    "tiny": dict(arch="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024),
    "tiny-moe": dict(arch="qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, vocab_size=1024),
    "tiny-mla": dict(arch="deepseek_v3", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=1, topk_group=1, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
                     qk_nope_head_dim=128, v_head_dim=128, num_hidden_layers=2, num_attention_heads=16,
                     num_key_value_heads=16, vocab_size=1024),
    "bench": dict(arch="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=128, vocab_size=32000),
    # 4 Qwen3-30B-A3B-shaped layers: hidden 2048, 128 experts x 768, 8 routed per token, 32 query / 4 KV heads (5.25 GB)
    "moe-bench": dict(arch="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_experts=128, num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, vocab_size=32000),
}


def build_checkpoint(model: str, out: str) -> str:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    import transformers as tf

    spec = dict(MODELS[model])
    arch = spec.pop("arch")
    cfg_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                          "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)}[arch]
    torch.manual_seed(0)
    cfg = cfg_cls(**spec, max_position_embeddings=512, torch_dtype="bfloat16", tie_word_embeddings=False)
    if arch == "deepseek_v3":  # vLLM creates gate.e_score_correction_bias only for noaux_tc routing
        cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
    m = model_cls(cfg).to(torch.bfloat16)
    m.save_pretrained(out, safe_serialization=True)
    return out


def fraction(changed: float | list[float] | None, v: int) -> float | None:
    """The fraction of elements version ``v`` changes (``--delta``: one fraction, or several taken in turn from
    version 2 on); None: version ``v`` is new weights throughout."""
    if changed is None or v < 2:
        return None
    return changed[(v - 2) % len(changed)] if isinstance(changed, list) else changed


def version_state(base: dict, v: int, changed: float | list[float] | None = None) -> dict:
    """Deterministic weights of version ``v`` (v=0: the checkpoint's); ``changed`` (``--delta``): from version 2 on,
    each version changes only this fraction of the elements of the one before (a list: its fractions in turn)."""
    import torch

    if v == 0:
        return {k: t.clone() for k, t in base.items()}
    dev = next(iter(base.values())).device
    if changed is not None and v > 1:  # an RL-like step: a few elements move (scales keep their version-1 values)
        prev = version_state(base, v - 1, changed)
        g = torch.Generator(device=dev).manual_seed(2000 + v)
        f = fraction(changed, v)
        for k, t in prev.items():
            if "scale" not in k:
                hit = torch.rand(t.shape, generator=g, device=dev) < f
                t.copy_(torch.where(hit, (t.float() + 0.01 * torch.randn(t.shape, generator=g, device=dev)).to(t.dtype),
                                    t))
        return prev
    g = torch.Generator(device=dev).manual_seed(1000 + v)
    return {k: (t.float() * (1 + 0.01 * v) if "scale" in k else  # scales stay positive
                t.float() * (1 + 0.01 * v) + 0.002 * torch.randn(t.shape, generator=g, device=dev)).to(t.dtype)
            for k, t in base.items()}


def load_state(ckpt: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(ckpt, f)))
    return out


def save_version(src: str, dst: str, v: int, changed: float | list[float] | None = None) -> None:
    """Version ``v``'s checkpoint at ``dst`` (``src``'s config and other files)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    base = {k: t.to("cuda:0") for k, t in load_state(src).items()}
    save_file({k: t.cpu().contiguous() for k, t in version_state(base, v, changed).items()},
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
