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

import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from .localcluster import LocalCluster
from .output import emit_json

KINDS = ("engine_kill", "engine_kill_mid_sync", "producer_kill")
_CTX = mp.get_context("spawn")


def _replica_main(name: str, ckpt: str, init_info: dict, cmd: Any, out: Any) -> None:
    os.setpgrp()  # the parent kills the whole engine (this driver, its engine core, its workers) as one
    try:
        from ..integrations.vllm.guard import TornWeightsError, check_outputs
        from ..integrations.vllm.testing.reference import PROMPT, cpu_env, engine_kwargs, inspect_engine
        from vllm import LLM, SamplingParams

        cpu_env(1)
        llm = LLM(**engine_kwargs(ckpt, 1, False))
        llm.init_weight_transfer_engine({"init_info": init_info})
        out.send(("ready", name, None))
        while (msg := cmd.get()) is not None:
            kind, arg = msg
            if kind == "sync":
                try:
                    llm.start_weight_update()
                    llm.update_weights({"update_info": {"version": arg}})
                    llm.finish_weight_update(weight_version=str(arg))
                    out.send(("synced", name, {"weight_version": llm.get_weight_version()}))
                except Exception as e:
                    out.send(("synced", name, {"error": f"{type(e).__name__}: {e}"[:1500],
                                               "weight_version": llm.get_weight_version()}))
            elif kind == "inspect":
                state: dict[str, Any] = {"weight_version": llm.get_weight_version()}
                try:
                    res = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
                    check_outputs(res)
                    state["tokens"] = list(res[0].outputs[0].token_ids)
                    state["paths"] = inspect_engine(llm, arg, 1)
                except TornWeightsError as e:
                    state["refused"] = str(e)[:500]
                out.send(("inspected", name, state))
    except BaseException as e:
        out.send(("error", name, f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))


class _Replica:
    def __init__(self, name: str, ckpt: str, init_info: dict):
        self.name = name
        self.cmd = _CTX.Queue()
        self.rx, w = _CTX.Pipe(duplex=False)
        self.proc = _CTX.Process(target=_replica_main, args=(name, ckpt, init_info, self.cmd, w),
                                 daemon=False)  # vLLM starts its engine core as a child of this process
        self.proc.start()
        w.close()

    def recv(self, kind: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.rx.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                k, _, payload = self.rx.recv()
                if k == "error":
                    raise RuntimeError(payload)
                if k == kind:
                    return payload
            elif not self.proc.is_alive():
                return None
        raise TimeoutError(f"replica {self.name}: no {kind!r} within {timeout} s")

    def kill(self) -> float:
        t = time.time()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.join(10)
        return t

    def close(self) -> None:
        if self.proc.is_alive():
            self.cmd.put(None)
            self.proc.join(30)
        self.kill()  # whatever is left of its engine


def run_chaos_vllm(*, kills: int = 3, seed: int = 0, lease_s: float = 3.0, arch: str = "qwen3",
                   as_json: bool = False, workdir: str | None = None) -> dict[str, Any]:
    from ..integrations.vllm.testing.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
    from ..integrations.vllm.testing.reference import compare_with, fresh_reference

    rng = random.Random(seed)
    work = workdir or tempfile.mkdtemp(prefix="shardsync-chaos-vllm-")
    ckpt = build_tiny_checkpoint(arch, os.path.join(work, arch))
    base = load_checkpoint(ckpt)
    t_start = time.monotonic()
    cl = LocalCluster(None, producers=2, spec={"kind": "checkpoint", "path": ckpt}, external_consumers=2,
                      lease_s=lease_s, timeout_s=120)
    info = lambda n: {"coordinator": cl.coordinator, "token": cl.token, "replica": n,  # noqa: E731
                      "plan_dir": os.path.join(work, n), "timeout_s": 120}
    reps = {n: _Replica(n, ckpt, info(n)) for n in ("r0", "r1")}
    tally: dict[str, Any] = {"faults": 0, "by_kind": {}, "syncs": 0, "syncs_completed": 0, "deadlocks": 0,
                             "torn_served": 0, "mismatched": 0, "refused_torn": 0, "rejoined_exact": 0,
                             "compared": 0, "notes": []}
    refs: dict[int, Any] = {}
    rejoining: set[str] = set()
    try:
        for r in reps.values():
            r.recv("ready", 600)
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
            live = [r for r in reps.values() if r.proc.is_alive()]
            t_sync = time.monotonic()
            for r in live:
                r.cmd.put(("sync", v))
            try:
                res = cl.sync(v, faults=faults, tolerate=True)
                synced = {r.name: r.recv("synced", 300) for r in live}
            except TimeoutError as e:
                tally["deadlocks"] += 1
                tally["notes"].append(f"v{v} {kind}: DEADLOCK {e}")
                break
            tally["syncs"] += 1
            last_s = time.monotonic() - t_sync
            ok = {n for n, s in synced.items() if s is not None and "error" not in s}
            if not res["failed"] and len(ok) == len(synced):
                tally["syncs_completed"] += 1
            _check(tally, v, kind, reps, refs, base, ckpt, work, rejoining, ok, perturb, fresh_reference, compare_with)
            print(f"sync {v}: {kind:22s} victim {victim}: engines completed {sorted(ok)}; producers failed "
                  f"{sorted(res['failed'])}", file=sys.stderr)
            for n, r in list(reps.items()):  # restart what died, as a framework would
                if not r.proc.is_alive():
                    r.kill()
                    reps[n] = _Replica(n, ckpt, info(n))
                    reps[n].recv("ready", 600)
                    rejoining.add(n)
            if kind == "producer_kill":
                cl.restart(1)
    finally:
        for r in reps.values():
            r.close()
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
        if not r.proc.is_alive():
            continue
        d = os.path.join(work, f"inspect-v{v}-{n}")
        r.cmd.put(("inspect", d))
        st = r.recv("inspected", 300)
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
