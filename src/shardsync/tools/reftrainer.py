"""A tiny reference trainer: a random-init HF causal LM under FSDP2 (``fully_shard``), for tests and the demo.

The model is built from a config (no hub download) with a fixed seed, so every rank, and every run, starts
from the same weights: ``arch="qwen3"`` (``Qwen3ForCausalLM``) or ``arch="qwen3_moe"``
(``Qwen3MoeForCausalLM``, 4 experts, top-2). Sizes: vocab 256, hidden 64, 2 layers, 4 heads, 2 KV heads,
head_dim 16, intermediate 128 (MoE: 64 per expert), fp32 by default (trains on CPU with gloo; bf16 also
works). Each decoder layer and then the root are ``fully_shard``-ed over the data-parallel mesh; a 2-D mesh
named ``("dp", "tp")`` first applies Megatron-style tensor parallelism (column-parallel q/k/v/gate/up,
row-parallel o/down) on ``tp``. ``step(batch)`` runs forward, loss (next-token cross-entropy on the token
ids, or ``loss_fn(model, batch)``), backward and an AdamW step, so the weights change every step::

    dist.init_process_group("gloo", ...)
    trainer = RefTrainer(init_device_mesh("cpu", (world,)))
    loss = trainer.step(torch.randint(0, 256, (2, 16), generator=g))
    for names, tensors in trainer.source().iter_groups(): ...      # on every rank, in lockstep
    full = trainer.full_state_dict()                                # HF-named full tensors, on every rank
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ..sources.fsdp import FSDPSource, strip_wrappers

__all__ = ["RefTrainer", "tiny_config", "build_model", "TP_PLAN"]

TP_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
           "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}


def tiny_config(arch: str = "qwen3", **overrides: Any):
    """A tiny config of ``arch`` ("qwen3" or "qwen3_moe"); ``overrides`` replace any field."""
    kw: dict[str, Any] = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, intermediate_size=128,
                              max_position_embeddings=128, tie_word_embeddings=False)
    if arch == "qwen3":
        from transformers import Qwen3Config as Config
    elif arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig as Config
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=True)
    else:
        raise ValueError(f"unknown arch {arch!r}: 'qwen3' or 'qwen3_moe'")
    kw.update(overrides)
    return Config(**kw)


def build_model(arch: str = "qwen3", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                **overrides: Any) -> nn.Module:
    """The random-init model of ``tiny_config(arch, **overrides)``, identical for equal seeds."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(arch, **overrides)
    cfg._attn_implementation = "eager"
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype)


def _apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    style = {"col": ColwiseParallel, "row": RowwiseParallel}
    for layer in model.model.layers:
        plan = {k: style[v]() for k, v in TP_PLAN.items() if _has(layer, k)}   # MoE layers: attention only
        parallelize_module(layer, tp_mesh, plan)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


class RefTrainer:
    """One rank of an FSDP2 (optionally FSDP2 x TP) trainer of a tiny HF model.

    ``mesh``: a 1-D CPU/GPU device mesh (FSDP over all of it), a 2-D one named ``("dp", "tp")``, or None for
    a 1-D mesh over the whole default process group on CPU.
    """

    def __init__(self, mesh: DeviceMesh | None = None, *, arch: str = "qwen3", seed: int = 0,
                 dtype: torch.dtype = torch.float32, lr: float = 1e-2,
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                 name_map: Callable[[str], str | None] | None = None, **overrides: Any):
        if mesh is None:
            import torch.distributed as dist
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.mesh, self.loss_fn, self.name_map = mesh, loss_fn, name_map
        self.model = build_model(arch, seed=seed, dtype=dtype, **overrides)
        self.model.config.architectures = [type(self.model).__name__]  # before FSDP2 renames the class
        if mesh.ndim == 2:
            if mesh.mesh_dim_names != ("dp", "tp"):
                raise ValueError(f"a 2-D mesh must be named ('dp', 'tp'), got {mesh.mesh_dim_names}")
            _apply_tp(self.model, mesh["tp"])
            dp_mesh = mesh["dp"]
        elif mesh.ndim == 1:
            dp_mesh = mesh
        else:
            raise ValueError(f"mesh must be 1-D or 2-D, got {mesh.ndim}-D")
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.steps = 0

    def step(self, batch: Any) -> float:
        """One optimizer step on ``batch`` (token ids ``[B, T]`` for the default next-token loss); the loss."""
        self.model.train()
        if self.loss_fn is not None:
            loss = self.loss_fn(self.model, batch)
        else:
            loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.steps += 1
        return float(loss.detach())

    def save_config(self, out_dir: str) -> str:
        """The HF config (what an inference engine needs beside the weights) written to ``out_dir``."""
        self.model.config.save_pretrained(out_dir)
        return out_dir

    def source(self) -> FSDPSource:
        """A weight source over the sharded model (HF names, or ``name_map``'s)."""
        return FSDPSource(self.model, name_map=self.name_map)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, full (``DTensor.full_tensor()``: a collective, call it on every rank), by the same
        names as ``source()``."""
        out: dict[str, torch.Tensor] = {}
        for raw, p in self.model.named_parameters():
            name = strip_wrappers(raw)
            if self.name_map is not None and (name := self.name_map(name)) is None:
                continue
            p = p.detach()
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).clone()
        return out
