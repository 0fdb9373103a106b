"""One real vLLM engine with the shardsync backend in pull mode, written once (the only module of the harness that
imports vllm): the demo's rollout engines, the chaos run's replicas, the Ray engine actor, ``shardsync bench
--consumers vllm`` and the vLLM sync demo all drive it.

    e = VllmEngine(model_dir, name="r0", tp=1, coordinator=cluster.coordinator, token=cluster.token)
    e.sync(version)            # start -> update (its workers pull their slices) -> finish; never raises
    e.generate(prompts, n=8, max_tokens=6, seed=1)           # sampled answers (the torn guard checks them)
    e.inspect(out_dir)         # what it holds (every tensor, probe outputs, greedy tokens) or that it is torn
    e.check_fresh_load(ckpt)   # in its workers: every tensor vs a FRESH load of a checkpoint
    e.check_against_fresh(state)   # vs a FRESH engine started on the same weights
    e.close()                  # bounded: a dead engine cannot leave it waiting

``group=NAME`` instead of ``coordinator``/``token``: the group's address comes from Ray's registry (inside a Ray
actor). ``VllmReplicas`` drives several engines of this process at once. Hosted in a process of its own
(``hosts.Hosted``) an engine is killed as a whole process group: driver, engine core and workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from ...verify.reference import (PROMPT, compare_with, cpu_env, engine_kwargs, fresh_reference,
                                            generate, inspect_engine, shutdown)

__all__ = ["VllmEngine", "VllmReplicas", "FreshReferences", "parallel", "check_against_fresh", "vllm_cluster",
           "full_update"]


def parallel(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run each function in a thread of its own; their results in order (the first error is raised)."""
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


class VllmEngine:
    """``connect=False``: the engine starts now, its workers record, validate and register their plans at
    :meth:`init` (several engines then init at once: every consumer must register before any can)."""

    def __init__(self, model_dir: str, *, name: str = "r0", tp: int = 1, coordinator: Any = None, token: str = "",
                 transport: str = "tcp", group: str | None = None, plan_dir: str | None = None,
                 timeout_s: float = 120.0, validate: bool = True, seed: int | None = None, connect: bool = True,
                 delta: bool = False, session: str = "", direct_writes: bool = True):
        cpu_env(tp)  # before vLLM starts
        from vllm import LLM

        self.model_dir, self.name, self.tp = os.path.abspath(model_dir), name, tp
        self.plan_dir = plan_dir or tempfile.mkdtemp(prefix=f"shardsync-{name}-")
        self.llm = LLM(**engine_kwargs(model_dir, tp, False, **({} if seed is None else {"seed": seed})))
        info = {"replica": name, "plan_dir": self.plan_dir, "timeout_s": timeout_s, "validate": validate,
                **({"delta": True} if delta else {}), **({"session": session} if session else {}),
                **({} if direct_writes else {"direct_writes": False})}
        if group is not None:  # a Ray actor: the group's address, token and transport come from Ray's registry
            from ...integrations.ray import engine_init_info

            info = engine_init_info(group, **info)
        else:
            info.update(coordinator=coordinator, token=token, transport=transport)
        self.init_info = info
        if connect:
            self.init()

    def init(self, **changes: Any) -> None:
        """Initialise (again): ``changes`` replace init-info fields, e.g. a restarted trainer's ``coordinator``,
        ``token`` and ``session`` (the engine is taken over once the previous session's lease lapsed)."""
        self.init_info.update(changes)
        self.llm.init_weight_transfer_engine({"init_info": self.init_info})

    # ------------------------------------------------------------------ syncs
    def update(self, version: int, op: dict | None = None) -> None:
        """One sync (``op``: another update payload, e.g. the full-tensor baseline); raises if it failed."""
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": op or {"version": version}})
        self.llm.finish_weight_update(weight_version=str(version) if op is None else f"{version}-{op['op']}")

    def sync(self, version: int) -> dict[str, Any]:
        """Pull ``version`` (while the producers serve it); what this engine holds afterwards, and any error."""
        t0 = time.perf_counter()
        try:
            self.update(version)
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[:1500]
        return {"ok": err is None, "version": version, "weight_version": self.weight_version(), "error": err,
                "seconds": time.perf_counter() - t0, "bytes_received": self.bytes_received(),
                "wire_bytes": self.wire_bytes(), "delta_held_bytes": self.wire_bytes("delta_held_bytes"),
                "delta_live_bytes": self.wire_bytes("delta_live_bytes")}

    def weight_version(self) -> str | None:
        return self.llm.get_weight_version()

    def status(self) -> list[dict[str, Any]]:
        """Each worker's status file (rank order) after its last sync: bytes received, timings."""
        out = []
        for r in range(self.tp):
            try:
                with open(os.path.join(self.plan_dir, f"status_rank{r}.json")) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                out.append({})
        return out

    def bytes_received(self) -> int | None:
        got = [s.get("bytes_received") for s in self.status()]
        return None if None in got else sum(got)

    def wire_bytes(self, key: str = "bytes_received") -> int | None:
        """Bytes its workers read in the last sync (with delta sync: payloads plus dense reads); ``key``: another of
        their wire counters summed (``delta_held_bytes``: the held copy; ``delta_live_bytes``: chunks read back)."""
        got = [s.get("wire", {}).get(key) for s in self.status()]
        return None if None in got else sum(got)

    # ------------------------------------------------------------------ serving
    def generate(self, prompts: list[list[int]], *, n: int, max_tokens: int, seed: int,
                 temperature: float = 1.0) -> list[list[list[int]]]:
        """``n`` sampled answers per prompt (fixed length: end-of-sequence ignored), seeded per prompt."""
        from vllm import SamplingParams

        from ...integrations.vllm.guard import check_outputs

        params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, min_tokens=max_tokens,
                                 ignore_eos=True, seed=seed + i) for i in range(len(prompts))]
        res = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        check_outputs(res)
        return [[list(o.token_ids) for o in r.outputs] for r in res]

    def greedy(self) -> list[int]:
        """Greedy tokens on the fixed probe prompt (no torn guard: what the engine computes)."""
        return generate(self.llm)

    # ------------------------------------------------------------------ checks
    def inspect(self, out_dir: str) -> dict[str, Any]:
        """What it holds: ``weight_version``, greedy ``tokens`` (through the torn guard) and ``paths`` (every
        worker's tensors and probe outputs) — or ``refused``: it is torn and will not serve."""
        from vllm import SamplingParams

        from ...integrations.vllm.guard import TornWeightsError, check_outputs

        state: dict[str, Any] = {"weight_version": self.weight_version()}
        try:
            res = self.llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
            check_outputs(res)
            state["tokens"] = list(res[0].outputs[0].token_ids)
            state["paths"] = inspect_engine(self.llm, out_dir, self.tp)
        except TornWeightsError as e:
            state["refused"] = str(e)[:500]
        return state

    def check_fresh_load(self, checkpoint: str, out_dir: str | None = None) -> dict[str, Any]:
        """In its workers: every tensor (and probe output) it holds vs a fresh load of ``checkpoint``."""
        out_dir = out_dir or os.path.join(self.plan_dir, f"check-{os.path.basename(checkpoint)}")
        self.llm.init_weight_transfer_engine({"init_info": {"inspect_to": out_dir, "check_fresh": checkpoint}})
        with open(os.path.join(out_dir, "fresh_rank0.json")) as f:
            res = json.load(f)
        res["weight_version"] = self.weight_version()
        return res

    def check_against_fresh(self, state: dict, *, tag: str = "") -> tuple[bool, list[str], int]:
        return check_against_fresh([self], state, tag=tag)

    def close(self) -> None:
        try:  # bounded: a dead engine would leave this call waiting forever
            self.llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine", timeout=10)
        except Exception:
            pass
        shutdown(self.llm)


def check_against_fresh(engines: list[VllmEngine], state: dict, *, tag: str = "") -> tuple[bool, list[str], int]:
    """Compare every engine (same checkpoint and TP) with ONE fresh engine started on ``state`` (the trainer's
    weights of the version just synced): every tensor after processing, probe outputs, greedy tokens.
    Returns (exact, what differs, tensors and probes compared)."""
    out = tempfile.mkdtemp(prefix=f"shardsync-fresh{tag}-")
    try:
        synced = parallel([lambda i=i, e=e: (inspect_engine(e.llm, os.path.join(out, f"r{i}"), e.tp), e.greedy())
                           for i, e in enumerate(engines)])
        ref = fresh_reference(engines[0].model_dir, state, tp=engines[0].tp, ep=False, out_dir=out)
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


class FreshReferences:
    """FRESH engines started on ``checkpoint`` perturbed by each version (the trainer's weights of that version, as
    the local cluster's checkpoint trainers hold them): one per version, started on first use and kept."""

    def __init__(self, checkpoint: str, work: str, *, tp: int = 1):
        from ...verify.checkpoints import load_checkpoint

        self.checkpoint, self.work, self.tp = checkpoint, work, tp
        self.base = load_checkpoint(checkpoint)
        self.refs: dict[int, Any] = {}

    def compare(self, version: int, state: dict[str, Any]) -> tuple[int, list[str]]:
        """An engine's :meth:`VllmEngine.inspect` against the fresh engine of ``version``: (compared, differences)."""
        from ...verify.checkpoints import perturb

        if version not in self.refs:
            self.refs[version] = fresh_reference(self.checkpoint, perturb(self.base, version), tp=self.tp, ep=False,
                                                 out_dir=os.path.join(self.work, f"fresh-v{version}"))
        ref = self.refs[version]
        n, bad = compare_with(state["paths"], ref.paths)
        if state["tokens"] != ref.tokens:
            bad.append(f"greedy tokens {state['tokens']} != fresh engine's {ref.tokens}")
        return n, bad


def full_update(version: int, state: dict) -> dict[str, Any]:
    """The baseline's update payload: every full tensor of ``state`` (to every worker, through ``update_weights``
    and vLLM's own loaders, as RPC/broadcast-based syncs do); pass it as ``op`` to :meth:`VllmReplicas.sync`."""
    import torch

    from ...types import dtype_name

    return {"op": "full", "version": version,
            "tensors": [[n, dtype_name(t.dtype), list(t.shape),
                         t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()] for n, t in state.items()]}


class VllmReplicas:
    """Several engines of this process (``r0``, ``r1``, ...; TP ``tp`` each), driven at once.

        reps = VllmReplicas(model_dir, replicas=2, tp=2, coordinator=cluster.coordinator, token=cluster.token)
        reps.init(); reps.sync(version); reps.status(); reps.check_against_fresh(state); reps.close()
    """

    def __init__(self, model_dir: str, *, replicas: int, tp: int, coordinator: list[Any], token: str,
                 transport: str = "tcp", timeout_s: float = 120.0, validate: bool = True, delta: bool = False,
                 direct: Sequence[bool] | None = None):
        """``direct``: per replica, whether its workers write directly where the init check allows (default all)."""
        direct = [True] * replicas if direct is None else list(direct)
        if len(direct) != replicas:
            raise ValueError(f"direct names {len(direct)} replicas, expected {replicas}")
        self.engines = [VllmEngine(model_dir, name=f"r{i}", tp=tp, coordinator=coordinator, token=token,
                                   transport=transport, timeout_s=timeout_s, validate=validate, connect=False,
                                   delta=delta, direct_writes=direct[i])
                        for i in range(replicas)]

    def init(self) -> None:
        parallel([e.init for e in self.engines])

    def sync(self, version: int, op: dict | None = None) -> None:
        """One sync on every replica at once; raises the first failure."""
        parallel([lambda e=e: e.update(version, op) for e in self.engines])

    def status(self) -> list[dict]:
        return [s for e in self.engines for s in e.status()]

    def check_against_fresh(self, state: dict, *, tag: str = "") -> tuple[bool, list[str], int]:
        return check_against_fresh(self.engines, state, tag=tag)

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self.engines.clear()


@contextlib.contextmanager
def vllm_cluster(checkpoint: str, *, producers: int, replicas: int, tp: int, transport: str = "tcp",
                 timeout_s: float = 300.0, direct: Sequence[bool] | None = None) -> Iterator[tuple[Any, VllmReplicas]]:
    """Producer processes (the local cluster: PP shares of ``checkpoint``, perturbed by each version) serving
    ``replicas`` engines of TP ``tp`` in this process, every worker's plan registered: ``(cluster, replicas)``.

        with vllm_cluster(ckpt, producers=2, replicas=2, tp=2) as (cluster, reps):
            parallel([lambda: cluster.sync(1), lambda: reps.sync(1)])
    """
    from .cluster import LocalCluster

    cluster = LocalCluster(None, producers=producers, spec={"kind": "checkpoint", "path": checkpoint},
                           external_consumers=replicas * tp, transport=transport, timeout_s=timeout_s)
    try:
        reps = VllmReplicas(checkpoint, replicas=replicas, tp=tp, coordinator=cluster.coordinator,
                            token=cluster.token, transport=transport, timeout_s=timeout_s, direct=direct)
        try:
            reps.init()
            cluster.wait_ready()
            yield cluster, reps
        finally:
            reps.close()
    finally:
        cluster.close()
