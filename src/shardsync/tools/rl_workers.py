"""The demo's two kinds of workers, plain classes hosted in processes (``hosted.Hosted``) or Ray actors.

``PolicyRank``: one rank of the FSDP2 trainer (gloo) of a tiny Qwen3-style policy, and a shardsync
``Producer`` over it (``FSDPSource``: one all-gather per layer, each rank serving the groups routed to it).
``RolloutEngine``: a real vLLM engine (TP1, shardsync backend, pull mode) that samples answers, pulls every
new version from the trainer ranks, and checks itself against a FRESH load of a checkpoint.

    rank0 = PolicyRank(rank=0, world=2, port=p, work=w, ...)      # every rank, in its own process
    addr = rank0.start_producer(token, n_consumers=2)             # rank 0 hosts the coordinator
    rank1.start_producer(token, n_consumers=2, coordinator=addr)
    rank.init_producer()                                           # (all ranks) waits for the engines' plans
    eng = RolloutEngine(name="r0", checkpoint=w + "/ckpt-v0", coordinator=addr, token=token)
    answers = eng.generate(prompts, n=8, max_tokens=6, seed=1)
    rank.train(batch); rank.sync(v) | eng.sync(v)                  # at once
    rank.save(v)  -> checkpoint of version v (rank 0 writes); eng.check(ckpt) -> fresh-load comparison
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

__all__ = ["PolicyRank", "RolloutEngine", "MODEL"]

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
        from ..integrations.vllm.testing.reference import save_checkpoint

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


class RolloutEngine:
    def __init__(self, *, name: str, checkpoint: str, work: str, coordinator: Any = None, token: str = "",
                 group: str | None = None, timeout_s: float = 120.0):
        from ..integrations.vllm.testing.reference import cpu_env, engine_kwargs
        from vllm import LLM

        cpu_env(1)
        self.name, self.work = name, work
        self.plan_dir = os.path.join(work, f"engine-{name}")
        self.llm = LLM(**engine_kwargs(checkpoint, 1, False, seed=0))
        info = {"replica": name, "plan_dir": self.plan_dir, "timeout_s": timeout_s}
        if group is not None:  # a Ray actor: the group's address and token come from Ray's registry
            from ..integrations.ray import engine_init_info

            info = engine_init_info(group, **info)
        else:
            info.update(coordinator=coordinator, token=token)
        self.llm.init_weight_transfer_engine({"init_info": info})

    def generate(self, prompts: list[list[int]], *, n: int, max_tokens: int, seed: int,
                 temperature: float = 1.0) -> list[list[list[int]]]:
        """``n`` sampled answers per prompt (fixed length: end-of-sequence ignored), seeded per prompt."""
        from vllm import SamplingParams

        from ..integrations.vllm.guard import check_outputs

        params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, min_tokens=max_tokens,
                                 ignore_eos=True, seed=seed + i) for i in range(len(prompts))]
        res = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        check_outputs(res)
        return [[list(o.token_ids) for o in r.outputs] for r in res]

    def sync(self, version: int) -> dict[str, Any]:
        """Pull ``version`` from the trainer ranks (while they serve it); what this engine holds afterwards."""
        t0 = time.perf_counter()
        try:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"version": version}})
            self.llm.finish_weight_update(weight_version=str(version))
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[:1000]
        st = self._status()
        return {"weight_version": self.llm.get_weight_version(), "error": err,
                "seconds": time.perf_counter() - t0, "bytes_received": st.get("bytes_received")}

    def _status(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.plan_dir, "status_rank0.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def check(self, checkpoint: str) -> dict[str, Any]:
        """Compare every tensor (and probe output) this engine holds with a fresh load of ``checkpoint``."""
        out_dir = os.path.join(self.work, f"check-{self.name}-{os.path.basename(checkpoint)}")
        self.llm.init_weight_transfer_engine({"init_info": {"inspect_to": out_dir, "check_fresh": checkpoint}})
        with open(os.path.join(out_dir, "fresh_rank0.json")) as f:
            res = json.load(f)
        res["weight_version"] = self.llm.get_weight_version()
        return res

    def close(self) -> None:
        from ..integrations.vllm.testing.reference import shutdown

        try:
            self.llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine", timeout=10)
        except Exception:
            pass
        shutdown(self.llm)
