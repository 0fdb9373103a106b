"""``shardsync chaos --vllm``: the chaos run's configuration with REAL vLLM engines on this machine.

Producer processes (PP shares of a tiny checkpoint) serve vLLM replicas, each a child process in its
own process group (so a fault kills the whole engine: driver, engine core, workers — kill -9). Faults,
drawn in turn:

- ``engine_kill``: a replica is killed between syncs; the next sync completes on the survivor, exact;
  the replica is then restarted under the same name, rejoins, and is exact at its next sync;
- ``engine_kill_mid_sync``: a replica is killed while a sync is in flight (same checks);
- ``producer_kill``: producer 1 dies mid-sync; every engine's update fails with ``ProducerLost``; an
  engine that applied groups is torn and must refuse to generate; producer 1 is restarted and the next
  sync heals every engine.

After each sync every live engine either refuses to serve (torn, by its own account) or is compared
with a FRESH engine started on the weights of the version it says it holds: every tensor after
processing, probe outputs, greedy tokens.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from .harness.cluster import LocalCluster
from .harness.hosts import Hosted, HostedDied
from .output import emit_json

KINDS = ("engine_kill", "engine_kill_mid_sync", "producer_kill")
ENGINE = "shardsync.tools.harness.vllm_engine:VllmEngine"


def _engine(name: str, ckpt: str, info: dict) -> Hosted:
    """A replica: the harness's vLLM engine in a process (group) of its own, up and registered."""
    h = Hosted(name, ENGINE, dict(model_dir=ckpt, name=name, **info))
    h.ready(600)
    return h


def _answer(call: Any, timeout: float) -> Any:
    """The call's result; None if the engine died before answering."""
    try:
        return call.result(timeout)
    except HostedDied:
        return None


def run_chaos_vllm(*, kills: int = 3, seed: int = 0, lease_s: float = 3.0, arch: str = "qwen3",
                   as_json: bool = False, workdir: str | None = None) -> dict[str, Any]:
    from ..integrations.vllm.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
    from ..integrations.vllm.reference import compare_with, fresh_reference

    rng = random.Random(seed)
    work = workdir or tempfile.mkdtemp(prefix="shardsync-chaos-vllm-")
    ckpt = build_tiny_checkpoint(arch, os.path.join(work, arch))
    base = load_checkpoint(ckpt)
    t_start = time.monotonic()
    cl = LocalCluster(None, producers=2, spec={"kind": "checkpoint", "path": ckpt}, external_consumers=2,
                      lease_s=lease_s, timeout_s=120)
    info = lambda n: {"coordinator": cl.coordinator, "token": cl.token,  # noqa: E731
                      "plan_dir": os.path.join(work, n), "timeout_s": 120}
    reps: dict[str, Hosted] = {}
    tally: dict[str, Any] = {"faults": 0, "by_kind": {}, "syncs": 0, "syncs_completed": 0, "deadlocks": 0,
                             "torn_served": 0, "mismatched": 0, "refused_torn": 0, "rejoined_exact": 0,
                             "compared": 0, "notes": []}
    refs: dict[int, Any] = {}
    rejoining: set[str] = set()
    try:
        booting = {n: Hosted(n, ENGINE, dict(model_dir=ckpt, name=n, **info(n))) for n in ("r0", "r1")}
        reps.update(booting)  # closed in any case
        for r in booting.values():
            r.ready(600)
        cl.wait_ready()
        v, last_s = 0, 2.0
        for i in range(kills + 1):
            kind = KINDS[i % len(KINDS)] if i < kills else "final"
            if kind != "final":
                tally["faults"] += 1
                tally["by_kind"][kind] = tally["by_kind"].get(kind, 0) + 1
            v += 1
            victim = rng.choice(sorted(reps))
            faults: dict[Any, dict] = {}
            if kind == "engine_kill":
                reps[victim].kill()
            elif kind == "engine_kill_mid_sync":  # within the span the last sync took
                threading.Timer(rng.uniform(0.1, 0.6) * last_s, reps[victim].kill).start()
            elif kind == "producer_kill":
                faults = {1: {"die_after_groups": 1}}
            live = [r for r in reps.values() if r.alive()]
            t_sync = time.monotonic()
            calls = {r.name: r.call("sync", v) for r in live}
            try:
                res = cl.sync(v, faults=faults, tolerate=True)
                synced = {n: _answer(c, 300) for n, c in calls.items()}
            except TimeoutError as e:
                tally["deadlocks"] += 1
                tally["notes"].append(f"v{v} {kind}: DEADLOCK {e}")
                break
            tally["syncs"] += 1
            last_s = time.monotonic() - t_sync
            ok = {n for n, s in synced.items() if s is not None and s["error"] is None}
            if not res["failed"] and len(ok) == len(synced):
                tally["syncs_completed"] += 1
            _check(tally, v, kind, reps, refs, base, ckpt, work, rejoining, ok, perturb, fresh_reference, compare_with)
            print(f"sync {v}: {kind:22s} victim {victim}: engines completed {sorted(ok)}; producers failed "
                  f"{sorted(res['failed'])}", file=sys.stderr)
            for n, r in list(reps.items()):  # restart what died, as a framework would
                if not r.alive():
                    r.kill()
                    reps[n] = _engine(n, ckpt, info(n))
                    rejoining.add(n)
            if kind == "producer_kill":
                cl.restart(1)
    finally:
        for r in reps.values():
            r.close(30)
        cl.close()
        shutil.rmtree(work, ignore_errors=True) if workdir is None else None
    out = {k: tally[k] for k in ("faults", "by_kind", "syncs", "syncs_completed", "deadlocks", "torn_served",
                                 "mismatched", "refused_torn", "rejoined_exact", "compared")}
    out["seconds"] = round(time.monotonic() - t_start, 1)
    f = sys.stderr if as_json else sys.stdout
    for k, val in out.items():
        print(f"{k:18s} {val}", file=f)
    for n in tally["notes"][-10:]:
        print("  " + n[:400], file=f)
    if as_json:
        emit_json(out)
    return out


def _check(tally, v, kind, reps, refs, base, ckpt, work, rejoining, ok, perturb, fresh_reference, compare_with):
    """Every live engine: refuses to serve (torn) or equals a fresh engine on the version it says it holds."""
    for n, r in reps.items():
        if not r.alive():
            continue
        st = _answer(r.call("inspect", os.path.join(work, f"inspect-v{v}-{n}")), 300)
        if st is None:
            continue
        if "refused" in st:
            tally["refused_torn"] += 1
            continue
        held = st["weight_version"]
        if held is None or not str(held).isdigit():
            continue  # never synced: its checkpoint weights, not a trainer version
        held = int(held)
        if held not in refs:
            refs[held] = fresh_reference(ckpt, perturb(base, held), tp=1, ep=False,
                                         out_dir=os.path.join(work, f"fresh-v{held}"))
        n_keys, bad = compare_with(st["paths"], refs[held].paths)
        if st["tokens"] != refs[held].tokens:
            bad.append(f"greedy tokens {st['tokens']} != fresh engine's {refs[held].tokens}")
        tally["compared"] += n_keys
        if bad:
            tally["mismatched" if n in ok else "torn_served"] += 1
            tally["notes"].append(f"v{v} {kind}: {n} holds version {held} but differs: {bad[:3]}")
        elif n in rejoining and n in ok:
            rejoining.discard(n)
            tally["rejoined_exact"] += 1
