"""``shardsync verify MODEL_DIR``: will my model work with shardsync? Real vLLM, bytes compared.

Starts real vLLM on the checkpoint with the shardsync backend, records the plans (init), perturbs every
tensor deterministically on the trainer side, syncs, and compares every engine tensor byte for byte
against vLLM's own loading of the same perturbed tensors in the same engine (captured before each
layer's processing, since CPU vLLM repacks linear weights into opaque handles, and again after it).
Greedy tokens are compared where vLLM on CPU can generate (not with expert parallelism).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback


from ...source import ModuleSource
from ...plan.validate import same_bytes
from .checkpoints import load_checkpoint, perturb
from .trainer import pack_updates, read_plans

PROMPT = [{"prompt_token_ids": [1, 17, 42, 99, 7, 3]}]


def _generate(llm) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _compare(a_path: str, b_path: str) -> tuple[int, list[str]]:
    from safetensors.torch import load_file

    a, b = load_file(a_path), load_file(b_path)
    bad = sorted(k.split(":", 1)[1] + (" (" + k.split(":")[0] + ")") for k in a.keys() ^ b.keys())
    for k in sorted(a.keys() & b.keys()):
        if not same_bytes(a[k], b[k]):
            bad.append(f"{k.split(':', 1)[1]} ({k.split(':')[0]})")
    return len(a.keys() | b.keys()), bad


def engine_kwargs(model_dir: str, tp: int, expert_parallel: bool) -> dict:
    return dict(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                gpu_memory_utilization=0.4, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel,
                weight_transfer_config={"backend": "shardsync"})


def cpu_env(tp: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))


def verify_engine(llm, model_dir: str, *, tp: int, ep: bool, validate: bool = True, seed: int = 1,
                  version: int = 1, corrupt: bool = False, result: dict | None = None) -> dict:
    """Run the verification on an already started engine. ``corrupt`` flips one byte of what rank 0
    receives (a self-test: the comparison must then fail)."""
    plan_dir = tempfile.mkdtemp(prefix="shardsync-verify-")
    result = {} if result is None else result  # filled in place: a caller keeps what was found before a failure
    result.update({"model": os.path.basename(os.path.normpath(model_dir)), "tp": tp, "ep": ep, "exact": False,
                   "tokens_match": None, "params_compared": 0, "mismatched": [], "bytes_received_per_rank": [],
                   "full_model_bytes": 0, "init_s": None, "sync_s": None})
    try:
        full = perturb(load_checkpoint(model_dir), seed)
        source = ModuleSource(full)
        metas = source.metadata()
        result["full_model_bytes"] = sum(m.nbytes for m in metas)
        can_generate = not ep
        tokens0 = _generate(llm) if can_generate else None
        t0 = time.perf_counter()
        try:
            llm.init_weight_transfer_engine({"init_info": {"metadata": [m.to_dict() for m in metas],
                                                           "plan_dir": plan_dir, "validate": validate,
                                                           "capture": True}})
        except Exception:
            if can_generate:  # a failed init must leave the live weights as they were
                result["unchanged_after_failed_init"] = _generate(llm) == tokens0
            raise
        result["init_s"] = round(time.perf_counter() - t0, 3)
        if can_generate:
            result["dry_run_unchanged"] = _generate(llm) == tokens0
        plans = read_plans(plan_dir, tp)
        inits = [json.load(open(os.path.join(plan_dir, f"init_rank{r}.json"))) for r in range(tp)]
        result["validated_tensors_per_rank"] = [i["validated_tensors"] for i in inits]
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
        tokens_sync = _generate(llm) if can_generate else None
        llm.start_weight_update()  # reference: vLLM's own loaders on the same perturbed full tensors
        llm.update_weights({"update_info": {"op": "reference", "model_dir": os.path.abspath(model_dir),
                                            "seed": seed, "version": version}})
        llm.finish_weight_update(weight_version=f"{version}-reference")
        tokens_ref = _generate(llm) if can_generate else None
        mism: list[str] = []
        for r in range(tp):
            n, bad = _compare(os.path.join(plan_dir, f"capture_rank{r}_sync.safetensors"),
                              os.path.join(plan_dir, f"capture_rank{r}_reference.safetensors"))
            result["params_compared"] += n
            mism += [f"rank{r}:{b}" for b in bad]
        result["mismatched"] = mism
        result["exact"] = not mism and result["params_compared"] > 0
        if can_generate:
            result["tokens_match"] = tokens_sync == tokens_ref
            result["tokens_changed_by_sync"] = tokens_sync != tokens0
        result["unneeded_per_rank"] = [len(p.unneeded) for p in plans]
    finally:
        shutil.rmtree(plan_dir, ignore_errors=True)
    return result


def run_verify(model_dir: str, *, tp: int = 1, expert_parallel: bool = False, as_json: bool = False,
               validate: bool = True, corrupt: bool = False) -> int:
    cpu_env(tp)
    from vllm import LLM

    result: dict = {"model": os.path.basename(os.path.normpath(model_dir)), "tp": tp, "ep": expert_parallel,
                    "exact": False}
    try:
        llm = LLM(**engine_kwargs(model_dir, tp, expert_parallel))
        verify_engine(llm, model_dir, tp=tp, ep=expert_parallel, validate=validate, corrupt=corrupt, result=result)
    except Exception as e:  # a clear message, not only vLLM's worker traceback
        cause = str(e).strip().splitlines()
        result["error"] = f"{type(e).__name__}: {cause[-1] if cause else ''}"
        if os.environ.get("SHARDSYNC_DEBUG"):
            traceback.print_exc()
        print(f"shardsync verify: {model_dir} cannot be synced: {result['error']}", file=sys.stderr)
    print_summary(result)
    if as_json:
        print(json.dumps(result))
    return 0 if result.get("exact") else 1


def print_summary(r: dict) -> None:
    full = r.get("full_model_bytes") or 0
    print(f"model {r.get('model')}  tp={r.get('tp')} ep={r.get('ep')}  init {r.get('init_s')} s  sync {r.get('sync_s')} s")
    for i, b in enumerate(r.get("bytes_received_per_rank", [])):
        print(f"  rank {i}: received {b / 1e6:.3f} MB ({b / full:.0%} of {full / 1e6:.3f} MB)" if full else "")
    print(f"  tensors compared: {r.get('params_compared', 0)}  mismatched: {len(r.get('mismatched', []))}  "
          f"tokens match: {r.get('tokens_match')}")
    print("  EXACT: every engine tensor equals vLLM's own loading" if r.get("exact") else "  NOT EXACT")
