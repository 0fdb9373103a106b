"""The RL demo's loop (``shardsync demo``): an FSDP2 policy trained by GRPO on the toy task (``task``), its weights
synced into real vLLM engines after every optimizer step, rollouts sampled by those engines.

Each step (:func:`run_step`): the live engines sample answers for the step's prompts, the trainer ranks take one
GRPO step on them, every trainer rank serves the new version and every live engine pulls its bytes (shardsync,
point to point), then each engine compares everything it holds with a FRESH load of the trainer's weights of that
version (vLLM's loader, in the engine's worker; a digest and every tensor) — exactness is checked every step, not
trusted. ``kill_engine_at``: one engine is killed (SIGKILL to its whole process group) after that step's
rollouts; that step's sync completes on the survivor, the killed engine is restarted at once under its old name
and rejoins at the next sync. Trainer ranks (``harness.fsdp_trainer.PolicyRank``) and engines
(``harness.vllm_replica.VllmEngine``) are process hosts (``harness.hosts``): local processes, or Ray actors::

    loop = Loop(DemoConfig(steps=20, kill_engine_at=8), work); loop.start(progress)
    rec = run_step(loop, cfg, 1, rng, rejoining)          # one step's record; summarize(cfg, records, seconds)
"""

from __future__ import annotations

import os
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ...testing.harness.hosts import HostedDied, free_port, host_factory, results
from .task import Task, make_batch, make_prompts, rewards

__all__ = ["DemoConfig", "Loop", "run_step", "summarize"]

POLICY = "shardsync.testing.harness.fsdp_trainer:PolicyRank"
ENGINE = "shardsync.testing.harness.vllm_replica:VllmEngine"


@dataclass
class DemoConfig:
    steps: int = 20
    prompts: int = 8
    """Prompts per step (split over the live engines)."""
    samples: int = 8
    """Sampled answers per prompt (the GRPO group)."""
    replicas: int = 2
    trainer_ranks: int = 2
    lr: float = 1e-2
    seed: int = 0
    kill_engine_at: int | None = None
    lease_s: float = 3.0
    timeout_s: float = 180.0
    out: str = "shardsync-demo"
    use_ray: bool = False
    delta: bool = False
    """Delta sync: trainer ranks offer the words that changed, engines keep a held copy (docs/delta.md)."""
    task: Task = field(default_factory=Task)


def _raise_any(res: dict[str, Any], what: str) -> dict[str, Any]:
    bad = {k: v for k, v in res.items() if isinstance(v, BaseException)}
    if bad:
        raise RuntimeError(f"{what} failed: " + "; ".join(f"{k}: {str(v)[:1500]}" for k, v in bad.items()))
    return res


class Loop:
    def __init__(self, cfg: DemoConfig, work: str):
        self.cfg, self.work = cfg, work
        self.token = secrets.token_hex(8)
        self.host = host_factory(cfg.use_ray)
        self.ranks: list[Any] = []
        self.engines: dict[str, Any] = {}
        self.booting: dict[str, Any] = {}
        self.coordinator: Any = None
        self.ckpt0 = ""
        self.group = f"demo-{self.token[:8]}" if cfg.use_ray else None
        self.watch: Any = None

    # ------------------------------------------------------------------ start-up
    def start(self, progress: Any) -> None:
        cfg, port = self.cfg, free_port()
        task = progress.add_task("trainer ranks (FSDP2, gloo)", total=None)
        self.ranks = [self.host(f"rank{r}", POLICY,
                                dict(rank=r, world=cfg.trainer_ranks, port=port, work=self.work,
                                     vocab=cfg.task.vocab, lr=cfg.lr, seed=cfg.seed)) for r in range(cfg.trainer_ranks)]
        for r in self.ranks:
            r.ready(600)
        self.ckpt0 = os.path.join(self.work, "ckpt-v0")
        kw = dict(n_consumers=cfg.replicas, lease_s=cfg.lease_s, timeout_s=cfg.timeout_s, group=self.group,
                  delta=cfg.delta)
        self.coordinator = self.ranks[0].call("start_producer", self.token, **kw).result(60)
        for r in self.ranks[1:]:
            r.call("start_producer", self.token, coordinator=self.coordinator, **kw).result(60)
        if self.group is not None:  # a dead engine actor is dropped at once (not after its lease)
            from ...integrations.ray import EngineWatch
            self.watch = EngineWatch(self.group)
        inits = {f"rank{i}": r.call("init_producer") for i, r in enumerate(self.ranks)}
        progress.update(task, description="trainer ranks ready; producers waiting for the engines' plans")
        etask = progress.add_task(f"{cfg.replicas} vLLM engines (record + validate plans)", total=cfg.replicas)
        for i in range(cfg.replicas):
            self._boot(f"r{i}")
        deadline = time.monotonic() + 900
        while self.booting:
            self._admit(wait_s=min(5.0, max(0.0, deadline - time.monotonic())))
            progress.update(etask, completed=len(self.engines))
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines {sorted(self.booting)} not up within 900 s")
        _raise_any(results(inits, 300), "producer init")
        progress.update(task, completed=1, total=1)

    def _boot(self, name: str) -> None:
        where = dict(group=self.group) if self.group is not None else dict(coordinator=self.coordinator,
                                                                            token=self.token)
        self.booting[name] = self.host(name, ENGINE, dict(model_dir=self.ckpt0, name=name, seed=0,
                                                          plan_dir=os.path.join(self.work, f"engine-{name}"),
                                                          timeout_s=self.cfg.timeout_s, delta=self.cfg.delta,
                                                          **where))

    def _admit(self, wait_s: float = 0.0) -> list[str]:
        """Engines whose start-up finished join the live set (they registered with the coordinator)."""
        joined = []
        t_end = time.monotonic() + wait_s
        while True:
            for name, h in list(self.booting.items()):
                if h.started():
                    h.ready(1)  # raises the constructor's error, if any
                    self.engines[name] = self.booting.pop(name)
                    joined.append(name)
                    if self.watch is not None:
                        self.watch.watch(h.actor, [f"{name}/rank0"])
            if joined or not self.booting or time.monotonic() >= t_end:
                return joined
            time.sleep(0.2)

    # ------------------------------------------------------------------ one step
    def rollouts(self, prompts: list[list[int]], seed: int) -> list[list[list[int]]]:
        live = sorted(self.engines)
        shares = {n: list(range(i, len(prompts), len(live))) for i, n in enumerate(live)}
        calls = {n: self.engines[n].call("generate", [prompts[j] for j in idx], n=self.cfg.samples,
                                         max_tokens=self.cfg.task.answer_len, seed=seed * 1000 + min(idx, default=0))
                 for n, idx in shares.items() if idx}
        res = _raise_any(results(calls, self.cfg.timeout_s), "rollouts")
        answers: list[Any] = [None] * len(prompts)
        for n, idx in shares.items():
            for j, a in zip(idx, res.get(n, [])):
                answers[j] = a
        return answers

    def kill(self, name: str) -> None:
        self.engines.pop(name).kill()
        self._boot(name)  # restarted at once, as a framework would; it rejoins once it is up

    def sync(self, version: int) -> tuple[dict, dict]:
        calls = {f"rank{i}": r.call("sync", version) for i, r in enumerate(self.ranks)}
        calls.update({n: e.call("sync", version) for n, e in self.engines.items()})
        res = results(calls, self.cfg.timeout_s * 2)
        prod = _raise_any({k: v for k, v in res.items() if k.startswith("rank")}, f"sync v{version} (trainer)")
        engines = {k: v for k, v in res.items() if not k.startswith("rank")}
        for n, v in engines.items():
            if isinstance(v, HostedDied):
                self.engines.pop(n, None)
        return prod, engines

    def check(self, version: int) -> tuple[dict, dict]:
        saved = _raise_any(results({f"rank{i}": r.call("save", version) for i, r in enumerate(self.ranks)},
                                    120), f"checkpoint v{version}")
        ckpt = saved["rank0"]["path"]
        res = results({n: e.call("check_fresh_load", ckpt) for n, e in self.engines.items()}, 300)
        return saved, res

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        for h in [*self.engines.values(), *self.booting.values()]:
            h.close(30)
        for r in self.ranks:
            r.close(30)
        if self.group is not None:
            from ...integrations.ray import forget
            forget(self.group)


def run_step(loop: Loop, cfg: DemoConfig, step: int, rng: random.Random, rejoining: dict[str, int]) -> dict:
    rec: dict[str, Any] = {"step": step}
    prompts = make_prompts(rng, cfg.prompts, cfg.task)
    t0 = time.monotonic()
    answers = loop.rollouts(prompts, seed=cfg.seed * 100_000 + step)
    rec["rollout_s"] = time.monotonic() - t0
    r = rewards(prompts, answers)
    rec["reward"] = sum(map(sum, r)) / sum(map(len, r))
    rec["rollout_engines"] = sorted(loop.engines)
    if cfg.kill_engine_at == step and len(loop.engines) > 1:
        victim = sorted(loop.engines)[-1]
        loop.kill(victim)
        rec["killed"] = victim
        rejoining[victim] = step
    batch = make_batch(prompts, answers, r, cfg.task)
    losses = _raise_any(results({f"rank{i}": h.call("train", batch) for i, h in enumerate(loop.ranks)}, 300),
                        f"train step {step}")
    rec["loss"] = sum(losses.values()) / len(losses)
    if loop.booting and step > min(rejoining.values(), default=step):  # the restarted engine rejoins now
        deadline = time.monotonic() + 600
        while loop.booting and time.monotonic() < deadline:
            loop._admit(wait_s=5.0)
    t0 = time.monotonic()
    prod, eng = loop.sync(step)
    rec["sync_s"] = time.monotonic() - t0
    rec["synced"] = sorted(n for n, v in eng.items() if isinstance(v, dict) and v.get("error") is None)
    rec["sync_errors"] = {n: (v.get("error") if isinstance(v, dict) else str(v)[:300]) for n, v in eng.items()
                          if not (isinstance(v, dict) and v.get("error") is None)}
    rec["bytes_per_engine"] = {n: v.get("bytes_received") for n, v in eng.items() if isinstance(v, dict)}
    rec["wire_bytes_per_engine"] = {n: v.get("wire_bytes") for n, v in eng.items() if isinstance(v, dict)}
    rec["dropped"] = sorted({c for p in prod.values() for c in (p.get("dropped") or {})})
    rec["members"] = sorted({c for p in prod.values() for c in (p.get("members") or ())})
    saved, checks = loop.check(step)
    rec["weights_sha256"] = saved["rank0"]["hash"][:16]
    rec["model_bytes"] = saved["rank0"]["bytes"]
    exact = {}
    for n in rec["synced"]:
        c = checks.get(n)
        exact[n] = (isinstance(c, dict) and c["compared"] > 0 and c["n_mismatched"] == 0
                    and c["digest"] == c["fresh_digest"] and c["weight_version"] == str(step))
    rec["exact"] = exact
    rec["check_s"] = max((c["seconds"] for c in checks.values() if isinstance(c, dict)), default=0.0)
    rec["live_engines"] = len(loop.engines)
    rec["rejoined"] = sorted(n for n in rec["synced"] if n in rejoining and exact.get(n))
    for n in rec["rejoined"]:
        rejoining.pop(n)
    return rec


def summarize(cfg: DemoConfig, steps: list[dict], seconds: float) -> dict[str, Any]:
    all_exact = bool(steps) and all(s["exact"] and all(s["exact"].values()) and not s["sync_errors"] for s in steps)
    return {"steps": len(steps), "reward_first": steps[0]["reward"] if steps else None,
            "reward_last": steps[-1]["reward"] if steps else None,
            "syncs": [{"step": s["step"], "seconds": round(s["sync_s"], 3), "bytes_per_engine": s["bytes_per_engine"],
                       "wire_bytes_per_engine": s["wire_bytes_per_engine"],
                       "engines": s["synced"], "exact": all(s["exact"].values()) and bool(s["exact"])} for s in steps],
            "all_exact": all_exact,
            "killed": [{"step": s["step"], "engine": s["killed"]} for s in steps if "killed" in s],
            "rejoined": [{"step": s["step"], "engine": n} for s in steps for n in s["rejoined"]],
            "seconds": round(seconds, 1)}
