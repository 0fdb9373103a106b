"""``shardsync demo``: one command, three modes.

- default (:func:`run_rl_demo`): a small but genuine RL loop — an FSDP2 policy trained by GRPO, its weights synced
  into real vLLM engines after every optimizer step, rollouts sampled by those engines, every sync checked against
  a fresh load (``programs/rl``); ``--kill-engine-at STEP`` kills one engine, which restarts and rejoins.
- ``--sync-only`` (:func:`run_vllm_demo`): two trainer ranks (PP2 shares of a tiny Qwen3-MoE) serve two vLLM
  replicas of TP2 (four real workers, each pulling only its own slices); three syncs with changed weights, each
  replica then compared byte for byte with a FRESH vLLM engine on a checkpoint of the same weights.
- ``--sync-only --consumers zoo`` (:func:`run_zoo_demo`): loader-zoo consumers (vLLM loader semantics) in this
  process, fed by the in-process loopback sync; each rank receives only the bytes it keeps.

    report = run_rl_demo(DemoConfig(steps=20, kill_engine_at=8))
    ok = run_vllm_demo(replicas=2, tp=2, syncs=3)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from ..testing.harness.consumers import ZooConsumer
from ..verify.output import emit_json, json_mode
from .rl.loop import DemoConfig, Loop, run_step, summarize
from ..engine.inprocess import loopback_sync
from ..source import ModuleSource
from ..testing.zoo import ZooConfig, hf_state_dict

__all__ = ["DemoConfig", "run_rl_demo", "run_vllm_demo", "run_zoo_demo", "run"]


def run_rl_demo(cfg: DemoConfig, *, as_json: bool = False) -> dict[str, Any]:
    """The RL loop (the default mode): a line per step, then the summary table, ``report.json`` and the plot."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .rl.report import plot, step_line, summary_table

    os.makedirs(cfg.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="shardsync-rl-")
    console = Console(file=sys.stderr if as_json else sys.stdout)
    rng = random.Random(cfg.seed)
    steps: list[dict[str, Any]] = []
    t_start = time.monotonic()
    with json_mode(as_json):
        if as_json:
            os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the engines' log lines would bury the steps
        console.print(f"[bold]shardsync demo[/bold]: task — {cfg.task.describe()}")
        console.print(f"policy: Qwen3-style, {cfg.trainer_ranks} FSDP2 ranks (gloo); {cfg.replicas} vLLM engines "
                      f"(CPU) sample {cfg.samples} answers per prompt, {cfg.prompts} prompts per step; "
                      f"shardsync syncs after every optimizer step{'; on Ray' if cfg.use_ray else ''}")
        loop = Loop(cfg, work)
        try:
            with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                          console=console, transient=False) as progress:
                loop.start(progress)
            console.print(f"start-up: {time.monotonic() - t_start:.1f} s")
            rejoining: dict[str, int] = {}
            for step in range(1, cfg.steps + 1):
                rec = run_step(loop, cfg, step, rng, rejoining)
                steps.append(rec)
                console.print(step_line(rec), soft_wrap=True)
        finally:
            loop.close()
        report = summarize(cfg, steps, time.monotonic() - t_start)
        with open(os.path.join(cfg.out, "report.json"), "w") as f:
            json.dump({"config": {k: v for k, v in asdict(cfg).items() if k != "task"} | {"task": asdict(cfg.task)},
                       **report, "per_step": steps}, f, indent=1)
        plot(steps, os.path.join(cfg.out, "demo.png"), kill_at=cfg.kill_engine_at, engines=cfg.replicas)
        console.print(summary_table(steps, report))
        console.print(f"report: {os.path.join(cfg.out, 'report.json')}   plot: {os.path.join(cfg.out, 'demo.png')}")
        shutil.rmtree(work, ignore_errors=True)
        if as_json:
            emit_json(report)
    return report


def run_vllm_demo(*, arch: str = "qwen3_moe", producers: int = 2, replicas: int = 2, tp: int = 2, syncs: int = 3,
                  transport: str = "tcp", as_json: bool = False, workdir: str | None = None) -> bool:
    """``--sync-only`` (vLLM): producer processes (PP shares of a tiny checkpoint, perturbed per version) serve vLLM
    replicas in this process; after each sync every replica is compared with a FRESH engine on the same weights."""
    from ..verify.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
    from ..testing.harness.vllm_replica import parallel, vllm_cluster

    workdir = workdir or os.path.join(tempfile.gettempdir(), "shardsync-demo")
    ckpt = build_tiny_checkpoint(arch, os.path.join(workdir, arch))
    base = load_checkpoint(ckpt)
    full_bytes = sum(t.nbytes for t in base.values())
    print(f"checkpoint {ckpt}: {full_bytes / 1e6:.2f} MB; {producers} producers (PP shares) -> "
          f"{replicas} vLLM replicas x TP{tp} over {transport}")
    t0 = time.perf_counter()
    with vllm_cluster(ckpt, producers=producers, replicas=replicas, tp=tp, transport=transport) as (cluster, reps):
        print(f"init (engines started, plans recorded + validated, routes agreed): {time.perf_counter() - t0:.1f} s")
        all_ok = True
        for v in range(1, syncs + 1):
            ts = time.perf_counter()
            prod, _ = parallel([lambda: cluster.sync(v), lambda: reps.sync(v)])
            dt = time.perf_counter() - ts
            per = [s["bytes_received"] for s in reps.status()]
            exact, bad, n = reps.check_against_fresh(perturb(base, v), tag=f"-v{v}")
            all_ok &= exact
            print(f"sync v{v}: bytes/consumer {[f'{b / 1e6:.2f}MB' for b in per]} ({max(per) / full_bytes:.0%} of "
                  f"model max)  {dt:.2f} s  {sum(per) / dt / 1e9:.3f} GB/s  max resident groups "
                  f"{[p['max_resident'] for p in prod['producers']]}  exact vs fresh engine: "
                  f"{'yes' if exact else 'NO ' + str(bad[:3])} ({n} tensors/probes)")
            if as_json:
                emit_json({"version": v, "bytes_per_consumer": per, "seconds": dt, "exact": exact,
                           "tensors_compared": n, "full_model_bytes": full_bytes})
        print("summary: " + ("after every sync each replica holds what a fresh engine holds" if all_ok else "MISMATCH"))
        return all_ok


def run_zoo_demo(*, tp: int = 2, syncs: int = 3, layers: int = 4, as_json: bool = False) -> bool:
    """``--sync-only --consumers zoo``: loader-zoo TP consumers in this process, fed by the loopback sync."""
    cfg = ZooConfig.qwen3_moe_tiny(layers=layers, hidden=128, moe_inter=64, experts=16, vocab=1000)
    metas = ModuleSource(hf_state_dict(cfg)).metadata()
    full_bytes = sum(m.nbytes for m in metas)
    zoos = [ZooConsumer(cfg, f"tp{r}", tp=tp, tp_rank=r) for r in range(tp)]
    consumers = [z.local(metas) for z in zoos]
    for r, plan in enumerate(c.plan for c in consumers):
        print(f"rank {r}: plan {plan.digest[:12]}  {sum(len(g.scatters) for g in plan.groups)} slices in "
              f"{len(plan.groups)} groups, {plan.nbytes / 1e6:.2f} MB of {full_bytes / 1e6:.2f} MB")
    all_ok = True
    for version in range(1, syncs + 1):
        sd = hf_state_dict(cfg, seed=version)  # the trainer's weights after step `version`
        report = loopback_sync(ModuleSource(sd), consumers, version=version)
        ok = [not z.mismatched(sd) for z in zoos]  # vs what the engine's own loaders make of the full tensors
        all_ok &= all(ok)
        per = "  ".join(f"rank{r} {b / 1e6:.3f} MB ({b / full_bytes:.0%})"
                        for r, b in enumerate(report.bytes_per_consumer))
        print(f"sync v{version}: {per}  {report.seconds * 1e3:.1f} ms  bit-exact: {'yes' if all(ok) else 'NO'}")
        if as_json:
            emit_json({"version": version, "bytes_per_consumer": report.bytes_per_consumer,
                       "full_model_bytes": full_bytes, "seconds": report.seconds, "exact": all(ok)})
    print("all syncs bit-exact" if all_ok else "MISMATCH: some consumer differs from its own loaders' result")
    return all_ok


def run(args) -> int:
    """``shardsync demo``: 0 when every sync was exact (and, with ``--kill-engine-at``, the engine rejoined)."""
    if not args.sync_only:
        rep = run_rl_demo(DemoConfig(steps=args.steps, prompts=args.prompts, samples=args.samples,
                                     replicas=args.replicas, lr=args.lr, seed=args.seed,
                                     kill_engine_at=args.kill_engine_at, use_ray=args.ray, out=args.out,
                                     delta=args.delta),
                          as_json=args.json)
        return 0 if rep["all_exact"] and (args.kill_engine_at is None or rep["rejoined"]) else 1
    if args.consumers == "zoo":
        return 0 if run_zoo_demo(tp=args.tp, syncs=args.syncs, as_json=args.json) else 1
    return 0 if run_vllm_demo(producers=args.producers, replicas=args.replicas, tp=args.tp, syncs=args.syncs,
                              transport=args.transport, as_json=args.json) else 1
