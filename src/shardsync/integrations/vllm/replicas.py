"""Drive several real vLLM engines (replicas) with the shardsync backend in pull mode.

    reps = VllmReplicas(model_dir, replicas=2, tp=2, coordinator=cluster.coordinator, token=cluster.token)
    reps.init()                      # every worker records + validates its plan, registers, connects
    reps.sync(version)               # start -> update (workers pull) -> finish, on all replicas at once
    exact, mismatched, n = reps.check_against_fresh(state)   # vs a FRESH engine on the same weights
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Callable

from .testing.reference import compare_with, cpu_env, engine_kwargs, fresh_reference, generate, inspect_engine, shutdown


def _parallel(fns: list[Callable[[], Any]]) -> list[Any]:
    out: list[Any] = [None] * len(fns)
    errs: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return out


class VllmReplicas:
    def __init__(self, model_dir: str, *, replicas: int, tp: int, coordinator: list[Any], token: str,
                 transport: str = "tcp", timeout_s: float = 120.0, validate: bool = True):
        cpu_env(tp)
        from vllm import LLM

        self.model_dir, self.tp = os.path.abspath(model_dir), tp
        self.dirs = [tempfile.mkdtemp(prefix=f"shardsync-r{i}-") for i in range(replicas)]
        self.init_info = [{"plan_dir": d, "coordinator": coordinator, "token": token, "transport": transport,
                           "replica": f"r{i}", "timeout_s": timeout_s, "validate": validate}
                          for i, d in enumerate(self.dirs)]
        self.llms = [LLM(**engine_kwargs(model_dir, tp, False)) for _ in range(replicas)]

    def init(self) -> None:
        _parallel([lambda llm=llm, ii=ii: llm.init_weight_transfer_engine({"init_info": ii})
                   for llm, ii in zip(self.llms, self.init_info)])

    def sync(self, version: int, op: dict | None = None) -> None:
        def one(llm) -> None:
            llm.start_weight_update()
            llm.update_weights({"update_info": op or {"version": version}})
            llm.finish_weight_update(weight_version=str(version) if op is None else f"{version}-{op['op']}")
        _parallel([lambda llm=llm: one(llm) for llm in self.llms])

    def status(self) -> list[dict]:
        import json

        return [json.load(open(os.path.join(d, f"status_rank{r}.json"))) for d in self.dirs for r in range(self.tp)]

    def check_against_fresh(self, state: dict, *, tag: str = "") -> tuple[bool, list[str], int]:
        """Compare every replica with a FRESH engine started on ``state`` (the trainer's weights of the
        version just synced): every tensor after processing, probe outputs, greedy tokens."""
        import shutil

        out = tempfile.mkdtemp(prefix=f"shardsync-fresh{tag}-")
        try:
            synced = _parallel([lambda i=i, llm=llm: (inspect_engine(llm, os.path.join(out, f"r{i}"), self.tp),
                                                      generate(llm)) for i, llm in enumerate(self.llms)])
            ref = fresh_reference(self.model_dir, state, tp=self.tp, ep=False, out_dir=out)
            bad: list[str] = []
            total = 0
            for i, (paths, tokens) in enumerate(synced):
                n, mism = compare_with(paths, ref.paths)
                total += n
                bad += [f"r{i}/{x}" for x in mism]
                if tokens != ref.tokens:
                    bad.append(f"r{i}: greedy tokens {tokens} != fresh engine's {ref.tokens}")
            return not bad and total > 0, bad, total
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def close(self) -> None:
        for llm in self.llms:
            try:  # bounded: a dead engine would leave this call waiting forever
                llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine", timeout=10)
            except Exception:
                pass
            shutdown(llm)
        self.llms.clear()
