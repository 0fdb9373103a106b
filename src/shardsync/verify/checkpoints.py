"""Tiny random HF checkpoints for tests and ``verify``, and deterministic weight perturbation.

    path = build_tiny_checkpoint("qwen3_moe", "/tmp/tiny-qwen3-moe")
    full = perturb(load_checkpoint(path), seed=1)    # what "the trainer after one step" holds
"""

from __future__ import annotations

import glob
import os
import zlib
from typing import Callable

import torch

from ..kernels.fp8 import block_fp8

ARCHS = ("qwen3", "qwen3_moe", "qwen2", "mixtral", "phi3", "llama")

_COMMON = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=256, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)


_BENCH = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=2048, vocab_size=16000, max_position_embeddings=256, tie_word_embeddings=False)


def _config(arch: str, size: str = "tiny"):
    import transformers as tf

    if size == "bench":  # ~270 MB Qwen3-MoE: large enough for transfer times to dominate on this machine
        if arch != "qwen3_moe":
            raise ValueError("the bench size exists for qwen3_moe only")
        return tf.Qwen3MoeConfig(head_dim=128, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
                                 decoder_sparse_step=1, mlp_only_layers=[], **_BENCH)

    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=64, **_COMMON)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                 decoder_sparse_step=1, mlp_only_layers=[], **_COMMON)
    if arch == "qwen2":  # q/k/v biases
        return tf.Qwen2Config(**_COMMON)
    if arch == "mixtral":  # block_sparse_moe.experts.N.w1/w2/w3
        return tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **_COMMON)
    if arch == "phi3":  # fused qkv_proj and gate_up_proj on disk
        return tf.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **_COMMON)
    if arch == "llama":
        return tf.LlamaConfig(**_COMMON)
    raise ValueError(f"unknown tiny architecture {arch!r}; known: {ARCHS}")


def build_tiny_checkpoint(arch: str, out_dir: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                          size: str = "tiny") -> str:
    """Random-weight checkpoint of ``arch`` (built from its transformers config) in ``out_dir``."""
    import transformers as tf

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    torch.manual_seed(seed)
    cfg = _config(arch, size)
    cfg.initializer_range = 0.2  # large enough for distinct greedy tokens in a 2-layer model
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def with_architecture(src_dir: str, out_dir: str, arch: str) -> str:
    """A copy of a checkpoint whose config names another architecture class (fault injection)."""
    import json
    import shutil

    if not os.path.exists(os.path.join(out_dir, "config.json")):
        shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
        cfg_path = os.path.join(out_dir, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["architectures"] = [arch]
        json.dump(cfg, open(cfg_path, "w"))
    return out_dir


FP8_BLOCK = 128


def to_block_fp8(ckpt: str, *, block: int = FP8_BLOCK) -> str:
    """Rewrite a bf16 checkpoint in place as DeepSeek-V3-style block FP8: every 2-D linear weight of the decoder
    layers (routers excluded) becomes ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per ``block`` x
    ``block`` tile (partial edge tiles, as DeepSeek-V3's own checkpoints have; ``kernels.fp8.block_fp8``, the
    function a bf16 trainer's ``BlockFP8Source`` runs); ``config.json`` gets the matching ``quantization_config``."""
    def quantize(k: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale_inv = block_fp8(t, (block, block))
        return {k: q, k[: -len("weight")] + "weight_scale_inv": scale_inv}

    return quantize_checkpoint(ckpt, quantize, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                                "weight_block_size": [block, block]})


def to_channel_fp8(ckpt: str) -> str:
    """Rewrite a bf16 checkpoint in place as a compressed-tensors FP8 checkpoint (``float-quantized``): every 2-D
    linear weight of the decoder layers (routers excluded) becomes ``float8_e4m3fn`` with a float32 ``weight_scale``
    per output channel ([out, 1]; static, symmetric), activations quantised per token at run time (dynamic)."""
    fmax = torch.finfo(torch.float8_e4m3fn).max

    def quantize(k: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / fmax
        return {k: (t.float() / scale).to(torch.float8_e4m3fn),
                k[: -len("weight")] + "weight_scale": scale.float().contiguous()}

    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    return quantize_checkpoint(ckpt, quantize, {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**fp8, "strategy": "channel", "dynamic": False},
                                      "input_activations": {**fp8, "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head", "re:.*mlp.gate$"]})


def decoder_linear(name: str, t: torch.Tensor) -> bool:
    """A 2-D linear weight of a decoder layer, MoE routers (``mlp.gate``) excluded."""
    return name.endswith(".weight") and t.dim() == 2 and ".layers." in name and not name.endswith("mlp.gate.weight")


def quantize_checkpoint(ckpt: str, quantize: Callable[[str, torch.Tensor], dict[str, torch.Tensor]], qcfg: dict,
                        *, select: Callable[[str, torch.Tensor], bool] = decoder_linear) -> str:
    """Rewrite ``ckpt`` in place (one weights file): each tensor ``select`` picks is replaced by what
    ``quantize(name, tensor)`` returns (the quantised tensor under its name and its scales), the others are kept in
    order; ``config.json`` gets ``qcfg`` as its ``quantization_config``."""
    import json

    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for k, t in load_checkpoint(ckpt).items():
        out.update(quantize(k, t) if select(k, t) else {k: t})
    for f in glob.glob(os.path.join(ckpt, "*.safetensors")) + glob.glob(os.path.join(ckpt, "*.index.json")):
        os.remove(f)
    save_file({k: t.contiguous() for k, t in out.items()}, os.path.join(ckpt, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return ckpt


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    if not out:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return out


def perturb(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Deterministically change every tensor (same bytes in every process): w * (1 + 0.1·n1) + 0.01·n2 for
    floating tensors; int8 (quantised weights) by ±1 at random places, saturated."""
    out = {}
    for name, t in state.items():
        g = torch.Generator().manual_seed((zlib.crc32(name.encode()) ^ (seed * 2654435761)) & 0x7FFFFFFF)
        if t.dtype.is_floating_point:
            n1 = torch.randn(t.shape, generator=g)
            n2 = torch.randn(t.shape, generator=g)
            if name.endswith("scale_inv"):  # block-FP8 scales stay positive
                out[name] = (t.float() * (1 + 0.05 * n1.clamp(-1, 1))).to(t.dtype)
                continue
            new = t.float() * (1 + 0.1 * n1) + 0.01 * n2
            if t.element_size() == 1:  # FP8: casts do not saturate (out of range is NaN)
                lim = torch.finfo(t.dtype).max
                new = new.clamp(-lim, lim)
            out[name] = new.to(t.dtype)
        elif t.dtype == torch.int8:
            step = torch.randint(-1, 2, t.shape, generator=g, dtype=torch.int16)
            out[name] = (t.to(torch.int16) + step).clamp(-128, 127).to(torch.int8)
        else:
            out[name] = t.clone()
    return out
