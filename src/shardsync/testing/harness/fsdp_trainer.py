"""The FSDP2 trainer stand-ins: :class:`RefTrainer` (a tiny random-init HF causal LM under ``fully_shard``),
:class:`FSDPRank` (the local cluster's producer rank over it, really training between syncs) and
:class:`PolicyRank` (the demo's policy rank: GRPO steps, syncs, checkpoints).

RefTrainer is built from a config (no hub download) with a fixed seed, so every rank, and every run, starts from
the same weights: ``arch="qwen3"`` (``Qwen3ForCausalLM``) or ``arch="qwen3_moe"`` (``Qwen3MoeForCausalLM``, 4
experts, top-2). Sizes: vocab 256, hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128 (MoE: 64
per expert), fp32 by default (trains on CPU with gloo; bf16 also works). Each decoder layer and then the root are
``fully_shard``-ed over the data-parallel mesh; a 2-D mesh named ``("dp", "tp")`` first applies Megatron-style
tensor parallelism (column-parallel q/k/v/gate/up, row-parallel o/down) on ``tp``. ``step(batch)`` runs forward,
loss (next-token cross-entropy on the token ids, or ``loss_fn(model, batch)``), backward and an AdamW step, so the
weights change every step::

    dist.init_process_group("gloo", ...)
    trainer = RefTrainer(init_device_mesh("cpu", (world,)))
    loss = trainer.step(torch.randint(0, 256, (2, 16), generator=g))
    for names, tensors in trainer.source().iter_groups(): ...      # on every rank, in lockstep
    full = trainer.full_state_dict()                                # HF-named full tensors, on every rank

PolicyRank, one per trainer process (``hosts.Hosted``) or Ray actor::

    rank0 = PolicyRank(rank=0, world=2, port=p, work=w, ...)      # every rank, in its own process
    addr = rank0.start_producer(token, n_consumers=2)             # rank 0 hosts the coordinator
    rank1.start_producer(token, n_consumers=2, coordinator=addr)
    rank.init_producer()                                           # (all ranks) waits for the engines' plans
    rank.train(batch); rank.sync(v)                                # while the engines pull v
    rank.save(v)  -> checkpoint of version v (rank 0 writes), its hash
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ...sources.fsdp import FSDPSource, strip_wrappers
from .joined_rank import JoinedRank, join_group, serve

__all__ = ["RefTrainer", "tiny_config", "build_model", "TP_PLAN", "FSDPRank", "PolicyRank", "MODEL"]

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


class FSDPRank(JoinedRank):
    """One rank of the FSDP2 reference trainer (:class:`RefTrainer`) over all producer processes:
    ``set_version(v)`` runs one optimizer step on a batch seeded by ``v``; rank 0 then writes the full weights
    to ``{spec["dir"]}/v{v}.safetensors`` (what consumers are checked against)."""

    def __init__(self, spec: dict, rank: int, n: int):
        from ...source import ModuleSource

        self.spec, self.rank, self.n, self.trainer = spec, rank, n, None
        self.metas = ModuleSource(build_model(spec.get("arch", "qwen3"), seed=0)).metadata()  # no gather needed

    def _source(self):
        if self.trainer is None:
            join_group(self.spec, self.rank, self.n)
            self.trainer = RefTrainer(arch=self.spec.get("arch", "qwen3"), seed=0)
            self.source = self.trainer.source()
        return self.source

    def set_version(self, v: int) -> None:
        self._source()
        assert self.trainer is not None
        if v > 0:
            g = torch.Generator().manual_seed(v)
            self.trainer.step(torch.randint(0, 256, (2, 16), generator=g))
        full = self.trainer.full_state_dict()  # a collective: every rank
        if self.rank == 0:
            from safetensors.torch import save_file

            path = os.path.join(self.spec["dir"], f"v{v}.safetensors")
            save_file(full, path + ".tmp")
            os.replace(path + ".tmp", path)

    @property
    def stats(self) -> dict[str, Any]:
        return self._source().stats

    def held_names(self):
        return None  # every rank serves every group (gathered); known without joining the group


MODEL = dict(hidden_size=64, num_hidden_layers=2, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=128)
"""The policy's size (Qwen3 architecture; the vocabulary is the task's)."""


class PolicyRank:
    """One rank of the demo's FSDP2 trainer (gloo) of a tiny Qwen3-style policy, and a shardsync ``Producer`` over
    it (``FSDPSource``: one all-gather per layer, each rank serving the groups routed to it)."""

    def __init__(self, *, rank: int, world: int, port: int, work: str, vocab: int, lr: float, seed: int = 0,
                 threads: int = 1):
        import torch.distributed as dist

        from ...programs.rl.task import grpo_loss

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.rank, self.world, self.work = rank, world, work
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.trainer = RefTrainer(arch="qwen3", seed=seed, dtype=torch.bfloat16, lr=lr, loss_fn=grpo_loss,
                                  vocab_size=vocab, **MODEL)
        self.producer = None
        self.checkpoint0 = self.save(0)

    def start_producer(self, token: str, *, n_consumers: int, coordinator: Any = None, group: str | None = None,
                       lease_s: float = 3.0, timeout_s: float = 120.0, delta: bool = False) -> Any:
        """This rank's producer (rank 0: with the coordinator, whose address is returned). Inside a Ray actor pass
        ``group``: rank 0 publishes the address and token under that name, the others look them up."""
        if group is not None:  # a Ray actor: rank 0 publishes the group, the others look it up
            cfg = dict(group=group, **({"token": token} if self.rank == 0 else {}))
        else:
            cfg = dict(token=token, coordinator=coordinator)
        self.producer = serve(self.trainer.source(), rank=self.rank, n_producers=self.world, n_consumers=n_consumers,
                              lease_s=lease_s, timeout_s=timeout_s, init_timeout_s=600, delta=delta, **cfg)
        return self.producer.address

    def init_producer(self) -> None:
        self.producer.init()

    def train(self, batch: dict) -> float:
        from ...programs.rl.task import split_batch

        return self.trainer.step(split_batch(batch, self.rank, self.world))

    def sync(self, version: int) -> dict[str, Any]:
        out = self.producer.sync(version)
        return {k: out.get(k) for k in ("seconds", "bytes_sent", "completed", "dropped", "members", "gathered_bytes")}

    def save(self, version: int) -> dict[str, Any]:
        """The trainer's full weights of ``version`` (a collective: every rank): rank 0 writes them as a
        checkpoint; every rank returns their hash."""
        from ...integrations.vllm.fresh_check import state_digest
        from ...verify.reference import save_checkpoint

        full = self.trainer.full_state_dict()
        path = os.path.join(self.work, f"ckpt-v{version}")
        if self.rank == 0:
            cfg_dir = os.path.join(self.work, "config")
            if not os.path.isdir(cfg_dir):
                self.trainer.save_config(cfg_dir)
            save_checkpoint(full, cfg_dir, path)
        return {"path": path, "hash": state_digest(full), "bytes": sum(t.nbytes for t in full.values())}

    def close(self) -> None:
        import torch.distributed as dist

        if self.producer is not None:
            self.producer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
