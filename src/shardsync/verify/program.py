"""``shardsync verify MODEL_DIR``: will my model work with shardsync? Real vLLM, bytes compared.

Starts real vLLM on the checkpoint with the shardsync backend, records the plans (init), perturbs every
tensor deterministically on the trainer side, syncs, and compares what the synced engine holds — every
parameter and buffer after processing, the outputs of every linear / LM-head kernel on a probe input —
with a FRESH engine started on a checkpoint of the same perturbed weights (``--reference fresh``, the
default), and their greedy tokens where vLLM on CPU can generate (not with expert parallelism).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback

from .checkpoints import load_checkpoint, perturb
from .push import pack_updates, read_plans
from .reference import (compare_with, cpu_env, engine_kwargs, fresh_reference, generate,
                                                   inspect_engine, shutdown)
from ..source import ModuleSource


def verify_engine(llm, model_dir: str, *, tp: int, ep: bool, validate: bool = True, seed: int = 1,
                  version: int = 1, corrupt: bool = False, reference: str = "fresh",
                  result: dict | None = None, quantization: str | None = None, direct: bool = True) -> dict:
    """Run the verification on an already started engine. ``corrupt`` flips one byte of what rank 0
    receives (a self-test: the comparison must then fail). ``reference``: ``fresh`` (a second engine on
    the new weights) or ``none`` (sync only)."""
    plan_dir = tempfile.mkdtemp(prefix="shardsync-verify-")
    result = {} if result is None else result  # filled in place: a caller keeps what was found before a failure
    result.update({"model": os.path.basename(os.path.normpath(model_dir)), "tp": tp, "ep": ep, "exact": False,
                   "reference": reference, "tokens_match": None, "params_compared": 0, "mismatched": [],
                   "bytes_received_per_rank": [], "full_model_bytes": 0, "init_s": None, "sync_s": None})
    try:
        full = perturb(load_checkpoint(model_dir), seed)
        source = ModuleSource(full)
        metas = source.metadata()
        result["full_model_bytes"] = sum(m.nbytes for m in metas)
        can_generate = not ep
        tokens0 = generate(llm) if can_generate else None
        t0 = time.perf_counter()
        try:
            llm.init_weight_transfer_engine({"init_info": {"metadata": [m.to_dict() for m in metas],
                                                           "plan_dir": plan_dir, "validate": validate,
                                                           "direct_writes": direct}})
        except Exception:
            if can_generate:  # a failed init must leave the live weights as they were
                result["unchanged_after_failed_init"] = generate(llm) == tokens0
            raise
        result["init_s"] = round(time.perf_counter() - t0, 3)
        if can_generate:
            result["dry_run_unchanged"] = generate(llm) == tokens0
        plans = read_plans(plan_dir, tp)
        inits = [json.load(open(os.path.join(plan_dir, f"init_rank{r}.json"))) for r in range(tp)]
        result["validated_tensors_per_rank"] = [i["validated_tensors"] for i in inits]
        result["processing"] = inits[0]["processing"]
        result["tied"] = inits[0]["tied"]
        result["direct_modules_per_rank"] = [i["direct_modules"] for i in inits]
        result["general_modules_per_rank"] = [i["general_modules"] for i in inits]
        result["reloaded_modules_per_rank"] = [i["reloaded_modules"] for i in inits]
        result["modules_per_rank"] = [i["modules"] for i in inits]
        result["not_direct"] = inits[0]["not_direct"]
        by_name = {m.name: m for m in metas}
        result["fallback"] = [{"src": f.src, "dests": list(f.dests), "bytes": by_name[f.src].nbytes,
                               "reason": f.reason} for f in plans[0].fallback]
        updates = pack_updates(plans, source, version=version)
        if corrupt:
            name, data = next((g, d) for g, d in updates[0]["groups"] if g not in ("pre", "post") and d)
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x40
            updates[0]["groups"] = [[g, bytes(flipped) if g == name else d] for g, d in updates[0]["groups"]]
        result["expert_ids_per_rank"] = [sorted({int(n.split(".experts.")[1].split(".")[0]) for g in p.groups
                                                 for n in g.sources if ".experts." in n
                                                 and n.split(".experts.")[1].split(".")[0].isdigit()})
                                         for p in plans]
        t0 = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": updates})
        llm.finish_weight_update(weight_version=str(version))
        result["sync_s"] = round(time.perf_counter() - t0, 3)
        result["weight_version"] = llm.get_weight_version()
        statuses = [json.load(open(os.path.join(plan_dir, f"status_rank{r}.json"))) for r in range(tp)]
        result["bytes_received_per_rank"] = [s["bytes_received"] for s in statuses]
        result["payload_bytes_per_rank"] = [p.nbytes for p in plans]
        tokens_sync = generate(llm) if can_generate else None
        synced = inspect_engine(llm, os.path.join(plan_dir, "synced"), tp)
        if reference == "none":
            result["exact"] = None
            return result
        ref = fresh_reference(model_dir, full, tp=tp, ep=ep, out_dir=os.path.join(plan_dir, "ref"),
                              can_generate=can_generate, **({"quantization": quantization} if quantization else {}))
        n, mism = compare_with(synced, ref.paths)
        result["params_compared"] = n
        result["mismatched"] = mism
        if can_generate:
            result["tokens_match"] = tokens_sync == ref.tokens
            result["tokens_changed_by_sync"] = tokens_sync != tokens0
        result["exact"] = not mism and n > 0 and result["tokens_match"] is not False
        result["unneeded_per_rank"] = [len(p.unneeded) for p in plans]
    finally:
        shutil.rmtree(plan_dir, ignore_errors=True)
    return result


def run_verify(model_dir: str, *, tp: int = 1, expert_parallel: bool = False, as_json: bool = False,
               validate: bool = True, corrupt: bool = False, reference: str = "fresh",
               quantization: str | None = None, direct: bool = True) -> int:
    cpu_env(tp)
    from vllm import LLM

    result: dict = {"model": os.path.basename(os.path.normpath(model_dir)), "tp": tp, "ep": expert_parallel,
                    "quantization": quantization, "exact": False}
    llm = None
    try:
        llm = LLM(**engine_kwargs(model_dir, tp, expert_parallel,
                                  **({"quantization": quantization} if quantization else {})))
        verify_engine(llm, model_dir, tp=tp, ep=expert_parallel, validate=validate, corrupt=corrupt,
                      reference=reference, result=result, quantization=quantization, direct=direct)
    except Exception as e:  # a clear message, not only vLLM's worker traceback
        result["error"] = worker_error(e)
        if os.environ.get("SHARDSYNC_DEBUG"):
            traceback.print_exc()
        print(f"shardsync verify: {model_dir} cannot be synced: {result['error']}", file=sys.stderr)
    finally:
        if llm is not None:
            shutdown(llm)
    print_summary(result)
    if as_json:
        print(json.dumps(result), flush=True)
    return 0 if result.get("exact") or (reference == "none" and "error" not in result) else 1


def worker_error(e: BaseException) -> str:
    """The worker's own error where vLLM wrapped it (``Worker failed with error '...'``)."""
    text = str(e).strip()
    marker = "Worker failed with error '"
    if marker in text:
        inner = text.split(marker, 1)[1]
        inner = inner.rsplit("', please check the stack trace", 1)[0]
        return inner
    lines = text.splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def print_summary(r: dict) -> None:
    out = sys.stderr
    full = r.get("full_model_bytes") or 0
    print(f"model {r.get('model')}  tp={r.get('tp')} ep={r.get('ep')}  init {r.get('init_s')} s  "
          f"sync {r.get('sync_s')} s", file=out)
    for i, b in enumerate(r.get("bytes_received_per_rank", [])):
        if full:
            print(f"  rank {i}: received {b / 1e6:.3f} MB ({b / full:.0%} of {full / 1e6:.3f} MB)", file=out)
    if r.get("direct_modules_per_rank"):
        print(f"  written directly into live tensors: {r['direct_modules_per_rank']} modules per rank; general path "
              f"(buffers + first-load processing): {r['general_modules_per_rank']}; through vLLM's layerwise "
              f"reload each sync: {r.get('reloaded_modules_per_rank')} of {r.get('modules_per_rank')}", file=out)
    for k, rep in (r.get("processing") or {}).items():
        if rep.get("vllm_reload_differs") or rep.get("mode") != "inplace":
            print(f"  processing {k}: {rep['mode']}{'  (vLLM reload differs from a first load)' if rep.get('vllm_reload_differs') else ''}",
                  file=out)
    print(f"  compared with a fresh engine: {r.get('params_compared', 0)} tensors/probes, mismatched "
          f"{len(r.get('mismatched', []))}, tokens match: {r.get('tokens_match')}", file=out)
    print("  EXACT: the synced engine holds what a fresh engine holds" if r.get("exact") else "  NOT EXACT", file=out)
