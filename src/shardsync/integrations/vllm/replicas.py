"""Drive several real vLLM engines (replicas) with the shardsync backend in pull mode.

    reps = VllmReplicas(model_dir, replicas=2, tp=2, coordinator=cluster.coordinator, token=cluster.token)
    reps.init()                      # every worker records + validates its plan, registers, connects
    reps.sync(version)               # start -> update (workers pull) -> finish, on all replicas at once
    exact, mismatched = reps.check_against_reference(version)   # vLLM's own loading, byte for byte
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Callable

from .verify import _compare, cpu_env, engine_kwargs


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
                 transport: str = "tcp", timeout_s: float = 120.0, capture: bool = True, validate: bool = True):
        cpu_env(tp)
        from vllm import LLM

        self.model_dir, self.tp, self.capture = os.path.abspath(model_dir), tp, capture
        self.dirs = [tempfile.mkdtemp(prefix=f"shardsync-r{i}-") for i in range(replicas)]
        self.init_info = [{"plan_dir": d, "coordinator": coordinator, "token": token, "transport": transport,
                           "replica": f"r{i}", "timeout_s": timeout_s, "capture": capture, "validate": validate}
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

    def check_against_reference(self, version: int, *, op: str = "sync") -> tuple[bool, list[str], int]:
        """Load the same weights through vLLM's own loaders and compare every tensor captured by the last
        update of kind ``op`` (``sync``, or ``full`` for the baseline)."""
        self.sync(version, {"op": "reference", "model_dir": self.model_dir, "seed": version, "version": version})
        bad: list[str] = []
        total = 0
        for i, d in enumerate(self.dirs):
            for r in range(self.tp):
                n, mism = _compare(os.path.join(d, f"capture_rank{r}_{op}.safetensors"),
                                   os.path.join(d, f"capture_rank{r}_reference.safetensors"))
                total += n
                bad += [f"r{i}/rank{r}:{x}" for x in mism]
        return not bad and total > 0, bad, total

    def close(self) -> None:
        for llm in self.llms:
            try:
                llm.shutdown_weight_transfer_engine()
            except Exception:
                pass
        self.llms.clear()
