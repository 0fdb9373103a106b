"""Shared test helpers: bit-exact comparison and a plan-record-replay round trip over zoo models."""

from __future__ import annotations

import torch

from shardsync.engine.inprocess import loopback_sync
from shardsync.plan.validate import fill_sentinel, mismatched, raw_bytes as raw  # noqa: F401 (re-exported for tests)
from shardsync.source import ModuleSource
from shardsync.testing.harness.consumers import ZooConsumer
from shardsync.testing.harness.hosts import free_port  # noqa: F401 (re-exported for tests)
from shardsync.testing.zoo import ZooConfig


def garbage(model: torch.nn.Module) -> None:
    """Fill every parameter with a non-zero byte pattern."""
    with torch.no_grad():
        for p in model.parameters():
            fill_sentinel(p)


def zoo_roundtrip(cfg: ZooConfig, sd: dict[str, torch.Tensor], tp: int, ep: int = 1):
    """Record plans for every rank, sync through loopback into fresh models, return
    (mismatched names per rank, report, plans)."""
    src = ModuleSource(sd)
    zoos = [ZooConsumer(cfg, f"tp{r}", tp=tp, tp_rank=r, ep=ep, ep_rank=r % ep) for r in range(tp)]
    for z in zoos:
        garbage(z.live)  # the sync must write every byte the loader writes, padding included
    consumers = [z.local(src.metadata()) for z in zoos]
    report = loopback_sync(src, consumers)
    return [z.mismatched(sd) for z in zoos], report, [c.plan for c in consumers]


def run_rank_scripts(script: str, world: int, out, timeout_s: float, what: str) -> list[dict]:
    """Run ``python script RANK PORT OUT`` for every rank (a gloo group on a free port); each writes
    ``OUT/rank{R}.json``; returns them in rank order. Killed and failed (pytest) after ``timeout_s``."""
    import json
    import os
    import subprocess
    import sys
    import time

    import pytest

    port = free_port()
    tests = os.path.dirname(os.path.abspath(__file__))   # the rank scripts import ``helpers`` too
    path = os.pathsep.join([tests, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    procs = [subprocess.Popen([sys.executable, script, str(r), str(port), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline, logs = time.monotonic() + timeout_s, []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{what} ranks did not finish within {timeout_s}s")
    results = []
    for r, (p, log) in enumerate(zip(procs, logs)):
        path = out / f"rank{r}.json"
        assert p.returncode == 0 and path.exists(), f"rank {r} exited {p.returncode}:\n{log[-4000:]}"
        results.append(json.loads(path.read_text()))
    return results


def scenario(ranks: list[dict], name: str) -> list[dict]:
    """Every rank's result of one scenario (failing the test with the rank's traceback if it failed)."""
    for r, res in enumerate(ranks):
        assert name in res, f"rank {r} did not reach scenario {name!r}: {res}"
        assert "error" not in res[name], f"rank {r}, scenario {name}:\n{res[name]['error']}"
    return [res[name] for res in ranks]


def run_scenarios(scenarios, rank: int, outdir: str) -> None:
    """Rank side of ``run_rank_scripts``: run ``(name, thunk)`` scenarios in order, stop at the first failure
    (its traceback is the result; the peers then time out), write ``outdir/rank{R}.json``."""
    import json
    import os
    import traceback

    results = {}
    for name, fn in scenarios:
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            break
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
