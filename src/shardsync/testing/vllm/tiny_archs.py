"""Tiny random-weight HF checkpoints of more model families, each loaded and run in vLLM 0.32 on CPU.

    path = build("deepseek", "/tmp/tiny-deepseek")   # LLM(model=path, skip_tokenizer_init=True, ...)

Every name in ``FAMILIES`` was loaded in vLLM 0.32 (CPU, TP=1, bf16, enforce_eager) and generated 8
greedy tokens; ``CANNOT_LOAD`` gives the reason for the rest. The tokens matched transformers for all
but ``deepseek`` (gpt_oss: transformers in bf16). For deepseek, vLLM's CPU ``RotaryEmbedding.forward_cpu``
(``torch.ops._C.rotary_embedding``) mis-rotates the 3-D ``[T, heads, rope_dim]`` query that MLA passes
(``layers/mla.py``); with ``forward_native`` in its place vLLM's tokens match transformers. vLLM's own
deepseek tokens are still the same from run to run.
"""

from __future__ import annotations

import os

import torch

_COMMON = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)


def _config(family: str):
    import transformers as tf

    c = dict(_COMMON)
    if family == "mixtral":
        return tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=128, **c)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=128, intermediate_size=128,
                                 decoder_sparse_step=1, mlp_only_layers=[], **c)
    if family == "llama4":  # text-only Llama4ForCausalLM; experts.gate_up_proj [E, H, 2I], down_proj [E, I, H]
        return tf.Llama4TextConfig(num_local_experts=4, num_experts_per_tok=1, intermediate_size=48,
                                   intermediate_size_mlp=128, head_dim=32, interleave_moe_layer_step=1,
                                   attention_chunk_size=8192, **c)
    if family == "deepseek":  # MLA + MoE; the CPU MLA kernels need kv_lora_rank + qk_rope_head_dim == 576
        cfg = tf.DeepseekV3Config(q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                                  v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                  moe_intermediate_size=64, intermediate_size=128, first_k_dense_replace=1,
                                  n_group=1, topk_group=1, **{**c, "num_key_value_heads": 4})
        # transformers 5 dropped these keys (its model always routes this way); vLLM only creates
        # gate.e_score_correction_bias when topk_method == "noaux_tc", else KeyError at load
        cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
        return cfg
    if family == "gpt_oss":
        # unquantized bf16: sinks, interleaved gate_up_proj [E, H, 2I] with biases
        return tf.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, head_dim=32,
                               sliding_window=64, **c)
    if family == "qwen3_tied":
        c["tie_word_embeddings"] = True
        return tf.Qwen3Config(head_dim=32, intermediate_size=128, **c)
    if family in ("int8_w8a8", "int8_w8a8_static"):
        return tf.LlamaConfig(intermediate_size=128, **c)
    if family == "qwen3_fp8_block":  # every linear a multiple of the 128x128 FP8 block
        return tf.Qwen3Config(**{**c, "hidden_size": 256}, head_dim=64, intermediate_size=256)
    if family == "mamba2":
        return tf.Mamba2Config(hidden_size=128, num_hidden_layers=2, vocab_size=512, state_size=16, expand=2,
                               head_dim=32, num_heads=8, n_groups=1, chunk_size=64, tie_word_embeddings=False)
    if family == "jamba":
        return tf.JambaConfig(num_experts=1, intermediate_size=128, attn_layer_period=2, attn_layer_offset=1,
                              expert_layer_period=1, expert_layer_offset=0,
                              mamba_d_state=16, mamba_expand=2, **c)
    if family == "falcon_h1":  # every layer runs attention and a Mamba2 mixer in parallel
        return tf.FalconH1Config(intermediate_size=128, mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32,
                                 mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=64, **c)
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


# W8A8 int8: static symmetric per-channel int8 weights, dynamic symmetric per-token int8 activations.
_INT8_QCFG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True},
    }},
    "ignore": ["lm_head"],
}


_INT8_STATIC_QCFG = {**_INT8_QCFG, "config_groups": {"group_0": {
    **_INT8_QCFG["config_groups"]["group_0"],
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False},
}}}


def _quantize_int8(out_dir: str, *, static: bool = False) -> None:
    """Rewrite the bf16 checkpoint in ``out_dir``: every decoder-layer Linear weight -> int8 ``weight`` +
    float32 ``weight_scale`` of shape [out, 1] (``static``: and a per-tensor activation ``input_scale``); add
    ``quantization_config`` to config.json."""
    from ...verify.checkpoints import quantize_checkpoint

    def quantize(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        w = t.float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-8)
        stem = name[: -len("weight")]
        out = {name: torch.round(w / scale).clamp(-128, 127).to(torch.int8), stem + "weight_scale": scale}
        if static:  # calibrated activation range: a fixed 0.02 per tensor step here
            out[stem + "input_scale"] = torch.tensor([0.02], dtype=torch.float32)
        return out

    quantize_checkpoint(out_dir, quantize, _INT8_STATIC_QCFG if static else _INT8_QCFG,
                        select=lambda name, t: ".layers." in name and name.endswith("proj.weight") and t.dim() == 2)


def build(family: str, out_dir: str, *, seed: int = 0) -> str:
    """Random-weight bf16 checkpoint of ``family`` in ``out_dir`` (kept if config.json already exists)."""
    import transformers as tf

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    torch.manual_seed(seed)
    cfg = _config(family)
    cfg.initializer_range = 0.2  # large enough for distinct greedy tokens in a 2-layer model
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if family in ("int8_w8a8", "int8_w8a8_static"):
        _quantize_int8(out_dir, static=family.endswith("static"))
    if family == "qwen3_fp8_block":
        from ...verify.checkpoints import to_block_fp8

        to_block_fp8(out_dir)
    return out_dir


FAMILIES = ("mixtral", "qwen2_moe", "llama4", "deepseek", "gpt_oss", "qwen3_tied", "int8_w8a8",
            "int8_w8a8_static", "mamba2", "falcon_h1")
CANNOT_LOAD: dict[str, str] = {
    "qwen3_fp8_block": "CPU vLLM 0.32 builds no linear layer for a block-FP8 checkpoint: 'ValueError: Failed to find a "
                       "kernel that can implement the ScaledMM linear layer' at model init. On the GPU (vLLM 0.26, "
                       "H200) the same checkpoint syncs exactly (tests/gpu/test_gpu_vllm.py, fp8-block).",
    "jamba": "vLLM builds the engine, but the first generate fails in the Mamba1 mixer "
             "(vllm/model_executor/layers/mamba/mamba_mixer.py). With mamba_d_conv=4 the bf16 conv1d weight "
             "is prepacked to 2-D on AVX512-BF16 CPUs (layers/utils.py dispatch_cpu_unquantized_gemm) and "
             "forward_impl's conv1d.weight.size(2) raises 'IndexError: Dimension out of range (expected to be "
             "in range of [-2, 1], but got 2)'. With mamba_d_conv=3 it gets further and fails in "
             "ops/mamba_ssm.py selective_scan_fn: \"AttributeError: '_OpNamespace' '_C' object has no attribute "
             "'selective_scan_fwd'\" (the CPU build has no Mamba1 selective-scan op). falcon_h1 (Mamba2) is used "
             "as the hybrid instead.",
}
