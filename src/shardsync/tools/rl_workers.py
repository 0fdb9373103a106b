"""The demo's trainer workers, plain classes hosted in processes (``hosted.Hosted``) or Ray actors; its engines
are the harness's vLLM engine (``harness.vllm_engine.VllmEngine``: TP1, pull mode, a fresh-load check).

``PolicyRank``: one rank of the FSDP2 trainer (gloo) of a tiny Qwen3-style policy, and a shardsync
``Producer`` over it (``FSDPSource``: one all-gather per layer, each rank serving the groups routed to it).

    rank0 = PolicyRank(rank=0, world=2, port=p, work=w, ...)      # every rank, in its own process
    addr = rank0.start_producer(token, n_consumers=2)             # rank 0 hosts the coordinator
    rank1.start_producer(token, n_consumers=2, coordinator=addr)
    rank.init_producer()                                           # (all ranks) waits for the engines' plans
    rank.train(batch); rank.sync(v)                                # while the engines pull v
    rank.save(v)  -> checkpoint of version v (rank 0 writes), its hash
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["PolicyRank", "MODEL"]

MODEL = dict(hidden_size=64, num_hidden_layers=2, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=128)
"""The policy's size (Qwen3 architecture; the vocabulary is the task's)."""


class PolicyRank:
    def __init__(self, *, rank: int, world: int, port: int, work: str, vocab: int, lr: float, seed: int = 0,
                 threads: int = 1):
        import torch
        import torch.distributed as dist

        from .reftrainer import RefTrainer
        from .rl_task import grpo_loss

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.rank, self.world, self.work = rank, world, work
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.trainer = RefTrainer(arch="qwen3", seed=seed, dtype=torch.bfloat16, lr=lr, loss_fn=grpo_loss,
                                  vocab_size=vocab, **MODEL)
        self.producer = None
        self.checkpoint0 = self.save(0)

    def start_producer(self, token: str, *, n_consumers: int, coordinator: Any = None, group: str | None = None,
                       lease_s: float = 3.0, timeout_s: float = 120.0) -> Any:
        """This rank's producer (rank 0: with the coordinator, whose address is returned). Inside a Ray actor pass
        ``group``: rank 0 publishes the address and token under that name, the others look them up."""
        from ..engine.producer import Producer, ProducerConfig

        if group is not None:
            from ..integrations.ray import start_producer

            self.producer = start_producer(self.trainer.source(), group=group, rank=self.rank, n_producers=self.world,
                                           n_consumers=n_consumers, lease_s=lease_s, timeout_s=timeout_s,
                                           init_timeout_s=600, **({"token": token} if self.rank == 0 else {}))
            return self.producer.address
        cfg = ProducerConfig(rank=self.rank, n_producers=self.world, n_consumers=n_consumers, token=token,
                             coordinator=coordinator, lease_s=lease_s, timeout_s=timeout_s, init_timeout_s=600)
        self.producer = Producer(self.trainer.source(), cfg)
        return self.producer.address

    def init_producer(self) -> None:
        self.producer.init()

    def train(self, batch: dict) -> float:
        from .rl_task import split_batch

        return self.trainer.step(split_batch(batch, self.rank, self.world))

    def sync(self, version: int) -> dict[str, Any]:
        out = self.producer.sync(version)
        return {k: out.get(k) for k in ("seconds", "bytes_sent", "completed", "dropped", "members", "gathered_bytes")}

    def save(self, version: int) -> dict[str, Any]:
        """The trainer's full weights of ``version`` (a collective: every rank): rank 0 writes them as a
        checkpoint; every rank returns their hash."""
        from ..integrations.vllm.fresh_load import state_digest
        from ..integrations.vllm.reference import save_checkpoint

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
