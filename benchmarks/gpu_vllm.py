"""Real vLLM on a GPU: shardsync's vLLM backends (worker + trainer) against a FRESH GPU engine and vLLM's own ``ipc``.

One GPU, colocated: the trainer's tensors live in this (driver) process on ``cuda:0``; the engine core and its worker
run in vLLM's subprocess on the same GPU. Each phase runs in its own process (one engine at a time on the GPU):

* ``shardsync``: an engine with ``weight_transfer_config={"backend": "shardsync"}``; the trainer syncs ``--syncs``
  versions through vLLM's trainer API (``ShardsyncTrainerInitInfo``, device ``cuda:0``, transport ``auto``); seconds
  per sync; then every parameter and buffer's bytes (sha256, after processing), their addresses before and after the
  syncs (CUDA graphs capture addresses), and greedy tokens;
* ``fresh``: an engine started on the last version's checkpoint: the same probes;
* ``ipc``: vLLM's own ``ipc`` backend into the same kind of engine, the same versions (seconds per sync, probes);
* ``dense`` (``--delta ... --with-dense``): shardsync with delta off on the delta run's versions: the summary's
  ``delta`` gives, per changed fraction, both paths' median seconds and the bytes the worker read.

    python benchmarks/gpu_vllm.py --model tiny --graphs --json      # exactness, CUDA graphs on
    python benchmarks/gpu_vllm.py --model tiny-mla --quant fp8      # DeepSeek-V3-style MLA + MoE, FP8 online
    python benchmarks/gpu_vllm.py --model tiny --checkpoint fp8-block  # a block-FP8 checkpoint (128x128 scales)
    python benchmarks/gpu_vllm.py --model tiny --checkpoint fp8-block --trainer bf16
        # a bf16 trainer into that engine: BlockFP8Source quantises on the trainer; the fresh engine starts on the
        # same bf16 weights quantised by the same function (verify.checkpoints.to_block_fp8)
    python benchmarks/gpu_vllm.py --model tiny --checkpoint fp8-channel  # compressed-tensors FP8 (channel scales)
    python benchmarks/gpu_vllm.py --model tiny --torn               # + a sync aborted mid-way, then healed
    python benchmarks/gpu_vllm.py --model bench --baseline --json   # 24 Qwen3 layers (2.6 GB) vs vLLM's ipc
    python benchmarks/gpu_vllm.py --model moe-bench --graphs --general --baseline --json
        # 4 Qwen3-30B-A3B-shaped MoE layers (5.25 GB): the direct path, the general path (--no-direct), ipc, floor
    python benchmarks/gpu_vllm.py --model moe-bench --delta 0.001,0.01,0.05 --delta-mode always --with-dense \
        --syncs 7 --json      # delta at 0.1 / 1 / 5 % changed (two versions each) against dense, the same versions

Memory (colocated, one GPU): the trainer's figures are its process's CUDA allocator (the ring shardsync packs into
is allocated at ``trainer_init``; ``ipc`` exports the trainer's own tensors); the engine's are its worker's
allocator (receive slots at ``init_weight_transfer_engine``, transients during a sync) and the device-wide used
memory (``cudaMemGetInfo``, every process) at the same points.

With ``--json`` the last stdout line is the comparison. Needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the probes are
Python callables run in the worker) — set here for the child processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from gpu_vllm_weights import MODELS, build_checkpoint, fraction, load_state, save_version, version_state

PROMPTS = [[1, 17, 42, 99, 7, 3], [5, 6, 7, 8]]
CHANGED: list[float] | None = None
"""``--delta``: from version 2 on, each version changes only a fraction of the elements of the one before (these
fractions in turn)."""

def _probe(worker) -> dict:  # runs in the vLLM worker
    import hashlib

    import torch

    m = worker.model_runner.model
    out = {}
    for kind, items in (("p", m.named_parameters()), ("b", m.named_buffers())):
        for n, t in items:
            if t.is_meta:
                continue
            flat = t.detach().reshape(-1)
            raw = flat.view(torch.uint8) if flat.numel() and flat.dtype != torch.bool else flat.to(torch.uint8)
            out[f"{kind}:{n}"] = [hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest(), t.data_ptr(),
                                  list(t.shape), str(t.dtype)]
    return out


def _mem(worker) -> list[int]:  # runs in the vLLM worker: allocated now, peak since the last call
    import torch

    out = [torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()]
    torch.cuda.reset_peak_memory_stats()
    return out


def _device_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


KV_CACHE_BYTES = 2 << 30  # fixed, not profiled: several cases' engines can then share one GPU at once


def _llm(ckpt: str, graphs: bool, backend: str | None, quant: str | None = None, sleep: bool = False):
    from vllm import LLM

    kw = dict(model=ckpt, skip_tokenizer_init=True, enforce_eager=not graphs, max_model_len=256,
              gpu_memory_utilization=0.12, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0, quantization=quant,
              enable_sleep_mode=sleep)
    if backend:
        kw["weight_transfer_config"] = {"backend": backend}
    return LLM(**kw)


def _tokens(llm) -> list:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=12, temperature=0.0))
    return [list(o.outputs[0].token_ids) for o in outs]


def phase(args) -> dict:
    import torch

    ckpt = args.ckpt
    base = {k: t.to("cuda:0") for k, t in load_state(args.trainer_ckpt or ckpt).items()}
    t0 = time.perf_counter()
    # general: shardsync with every module on the general path; dense: shardsync with delta off (beside a delta run)
    shard = args.phase in ("shardsync", "general", "dense")
    args.no_direct = args.no_direct or args.phase == "general"
    llm = _llm(ckpt, args.graphs, None if args.phase == "fresh" else ("shardsync" if shard else "ipc"), args.quant,
               args.sleep and args.phase != "fresh")
    out: dict = {"phase": args.phase, "engine_start_s": round(time.perf_counter() - t0, 2)}
    if args.phase == "fresh":
        out["probe"] = llm.collective_rpc(_probe)[0]
        out["tokens"] = _tokens(llm)
        return out
    before = llm.collective_rpc(_probe)[0]
    out["tokens_before"] = _tokens(llm)
    state = version_state(base, 0, CHANGED)
    out["bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    if shard:  # the copy floor: the trainer's tensors copied once into as many GPU bytes (best of 3)
        dst = {k: torch.empty_like(t) for k, t in state.items()}
        floor = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k, t in state.items():
                dst[k].copy_(t)
            torch.cuda.synchronize()
            floor.append(time.perf_counter() - t0)
        out["copy_floor_s"] = round(min(floor), 5)
        del dst
    torch.cuda.synchronize()
    mem = {"trainer0": torch.cuda.memory_allocated(), "engine0": llm.collective_rpc(_mem)[0][0],
           "device0": _device_used()}
    torch.cuda.reset_peak_memory_stats()
    times = []
    if shard:
        source = _failing_source(state)
        served = source
        if args.trainer_ckpt:  # a bf16 trainer into the block-FP8 engine: quantised on the trainer, per group
            from shardsync import BlockFP8Source

            served = BlockFP8Source.for_checkpoint(source, ckpt)
        delta = (False if args.delta is None or args.phase == "dense" else
                 ("always" if args.delta_mode == "always" else True))
        eng = _shardsync_trainer(llm, served, delta=delta, direct=not args.no_direct, sync_memory=args.sync_memory)
        out["init_s"] = round(eng._init_s, 3)
        out["ring_bytes"] = eng.producer.stats["ring_bytes"]
        out["sync_memory_bytes"] = eng.producer.stats["sync_memory_bytes"]
        out["direct_modules"], out["general_modules"] = llm.collective_rpc(_direct_counts)[0]
        send = eng.send_weights
    else:
        send = _ipc_sender(llm, state)
    torch.cuda.synchronize()
    mem.update(trainer_init=torch.cuda.memory_allocated(), engine_init=llm.collective_rpc(_mem)[0][0],
               device_init=_device_used())
    torch.cuda.reset_peak_memory_stats()

    def step(v: int) -> None:  # the trainer's step: same tensors, new values
        if args.sleep:  # the engine sleeps while the trainer trains (weights to host, KV cache dropped)
            used = _device_used()
            llm.sleep(level=1)
            out.setdefault("sleep_freed_device_bytes", []).append(used - _device_used())
        new = version_state(base, v, CHANGED)
        for k, t in state.items():
            t.copy_(new[k])
        del new
        torch.cuda.synchronize()
        if args.sleep:
            llm.wake_up()

    trainer_peak = 0
    for v in range(1, args.syncs + 1):
        step(v)
        torch.cuda.reset_peak_memory_stats()  # the step's own temporaries are not the sync's
        t0 = time.perf_counter()
        send()
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t0, 4))
        trainer_peak = max(trainer_peak, torch.cuda.max_memory_allocated())
        if shard:  # stage clocks of this sync, trainer and worker side (read after the timed part)
            out.setdefault("clocks", []).append({"trainer": _clocks(eng.producer.stats, _TRAINER_CLOCKS),
                                                 "worker": llm.collective_rpc(_worker_clocks)[0]})
        if shard and args.delta is not None:  # the bytes the worker read this sync, the fraction it changed
            wire = llm.collective_rpc(_wire)[0]
            out.setdefault("wire_bytes", []).append(wire.get("bytes_received"))
            out.setdefault("changed", []).append(fraction(CHANGED, v))
    out["sync_s"] = times
    if shard and args.delta is not None and args.phase != "dense":  # the last sync's delta counters, both sides
        out["delta"] = {k: v for k, v in eng.producer.stats.items() if k.startswith("delta_")}
        out["delta_worker"] = llm.collective_rpc(_wire)[0]
    eng_now, eng_peak = llm.collective_rpc(_mem)[0]
    out["memory"] = {
        "trainer_after_init_extra_bytes": mem["trainer_init"] - mem["trainer0"],
        "trainer_sync_peak_extra_bytes": trainer_peak - mem["trainer0"],
        "engine_after_init_extra_bytes": mem["engine_init"] - mem["engine0"],
        "engine_sync_peak_extra_bytes": eng_peak - mem["engine0"],
        "engine_after_syncs_extra_bytes": eng_now - mem["engine0"],
        "device_after_init_extra_bytes": mem["device_init"] - mem["device0"],
        "device_after_syncs_extra_bytes": _device_used() - mem["device0"]}
    if args.torn and shard:
        out["torn"] = _torn_round(llm, send, source, step, args.syncs)
    after = llm.collective_rpc(_probe)[0]
    out["probe"] = after
    out["reallocated"] = sorted(k for k in after if k in before and after[k][1] != before[k][1])
    out["tokens"] = _tokens(llm)
    if shard:
        eng.shutdown()
    return out


def _failing_source(state):
    """The trainer's tensors; ``fail_after_s`` set: its last group raises after that many seconds (a trainer rank
    that dies mid-sync, after the earlier groups were served)."""
    from shardsync import ModuleSource

    class FailingSource(ModuleSource):
        fail_after_s: float | None = None

        def iter_groups(self):
            groups = list(super().iter_groups())
            for i, g in enumerate(groups):
                if self.fail_after_s is not None and i == len(groups) - 1:
                    time.sleep(self.fail_after_s)
                    raise RuntimeError("injected: the trainer died mid-sync")
                yield g

    return FailingSource(state)


def _torn_round(llm, send, source, step, last: int) -> dict:
    """A sync aborted mid-way (other weights), then a complete one of the last version: what the engine serves."""
    from vllm import SamplingParams

    r: dict = {}
    step(last + 50)
    source.fail_after_s = 3.0
    try:
        send()
        r["aborted_sync_error"] = None
    except Exception as e:  # noqa: BLE001 - recorded, the test asserts on it
        r["aborted_sync_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    source.fail_after_s = None
    label = getattr(llm, "get_weight_version", lambda: None)  # vLLM 0.26 labels no versions
    r["version_after_abort"], r["worker_after_abort"] = label(), llm.collective_rpc(_sync_state)[0]
    o = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0]
    r["served_after_abort"] = {"finish_reason": o.finish_reason, "tokens": list(o.token_ids),
                               "stop_reason": str(o.stop_reason)[:300]}
    step(last)
    send()
    r["version_after_heal"], r["worker_after_heal"] = label(), llm.collective_rpc(_sync_state)[0]
    if CHANGED is not None:  # delta sync: what the torn sync wrote is no base, so the heal read it dense
        r["delta_heal"] = llm.collective_rpc(_wire)[0]
    return r


_TRAINER_CLOCKS = ("seconds", "gather_s", "pack_s", "slot_wait_s")
_WORKER_CLOCKS = ("seconds", "apply_s", "read_s", "ready_wait_s")


def _clocks(stats: dict, keys: tuple[str, ...]) -> dict:
    return {k: round(float(stats[k]), 5) for k in keys if isinstance(stats.get(k), (int, float))}


def _worker_clocks(worker) -> dict:  # runs in the vLLM worker: its last update window and its consumer's clocks
    eng = worker.weight_transfer_engine
    return {"window_s": round(float(eng.last_status.get("seconds", 0.0)), 5),
            **_clocks(eng.consumer.stats if eng.consumer is not None else {}, _WORKER_CLOCKS)}


def _wire(worker) -> dict:  # runs in the vLLM worker: what its consumer read in the last sync
    return worker.weight_transfer_engine._wire


def _direct_counts(worker) -> list[int]:  # runs in the vLLM worker: modules written directly / on the general path
    eng = worker.weight_transfer_engine
    return [len(eng.direct), len(eng.not_direct)]


def _sync_state(worker) -> dict:  # runs in the vLLM worker: which versions its weight groups hold
    return worker.weight_transfer_engine.sync_state()


def _shardsync_trainer(llm, source, delta: bool | str = False, direct: bool = True, sync_memory: int | None = None):
    from shardsync.integrations.vllm import compat
    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo

    info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0,
                                    transport="auto", device="cuda:0", delta=delta, direct_writes=direct,
                                    sync_memory_bytes=sync_memory)
    t0 = time.perf_counter()
    eng = compat.factory_trainer_init(info, client=llm, source=source)
    eng._init_s = time.perf_counter() - t0
    return eng


def _ipc_sender(llm, state):
    """vLLM 0.26's own ipc backend, colocated: CUDA IPC handles of the trainer's tensors, one update call."""
    import base64
    import pickle

    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    llm.init_weight_transfer_engine({"init_info": {}})

    def send_mode(info) -> None:
        fields = {"names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes, "packed": info.packed,
                  "ipc_handles_pickled": base64.b64encode(pickle.dumps(info.ipc_handles)).decode()}
        if info.tensor_sizes is not None:
            fields["tensor_sizes"] = info.tensor_sizes
        llm.update_weights({"update_info": fields})

    def send() -> None:
        llm.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(iter(state.items()), {"send_mode": send_mode})
        llm.finish_weight_update()

    return send


def compare(a: dict, b: dict) -> list[str]:
    keys = set(a) | set(b)
    return sorted(k for k in keys if k not in a or k not in b or a[k][0] != b[k][0] or a[k][2:] != b[k][2:])


def summary(res: dict) -> dict:
    """Steady seconds a sync (the best after the first) per path, against the copy floor and vLLM's ipc."""
    floor = res.get("shardsync", {}).get("copy_floor_s")
    steady = {n: min(r["sync_s"][1:] or r["sync_s"]) for n in ("shardsync", "general", "dense", "ipc")
              if (r := res.get(n)) and r.get("sync_s")}
    out: dict = {"steady_sync_s": steady, "copy_floor_s": floor}
    d, dense = res.get("shardsync", {}), res.get("dense", {})
    if d.get("changed") and dense.get("sync_s"):  # delta vs dense at each fraction: medians over its versions, and
        # its last version alone (the first delta sync at a fraction also hashes chunks no stored hash covers yet)
        out["delta"] = {}
        for f in sorted({c for c in d["changed"] if c is not None}):
            at = [i for i, c in enumerate(d["changed"]) if c == f]
            med = statistics.median
            ds, ns = med([d["sync_s"][i] for i in at]), med([dense["sync_s"][i] for i in at])
            out["delta"][f"{f:g}"] = {"delta_sync_s": ds, "dense_sync_s": ns, "delta_over_dense": round(ds / ns, 2),
                                      "delta_wire_bytes": med([d["wire_bytes"][i] for i in at]),
                                      "dense_wire_bytes": med([dense["wire_bytes"][i] for i in at]),
                                      "versions": len(at), "last_delta_sync_s": d["sync_s"][at[-1]],
                                      "last_dense_sync_s": dense["sync_s"][at[-1]],
                                      "last_over_dense": round(d["sync_s"][at[-1]] / dense["sync_s"][at[-1]], 2)}
    if floor:
        out["x_copy_floor"] = {n: round(t / floor, 1) for n, t in steady.items()}
    if "ipc" in steady:
        out["ipc_over"] = {n: round(steady["ipc"] / t, 2) for n, t in steady.items() if n != "ipc"}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on (no enforce_eager)")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--baseline", action="store_true", help="also vLLM's own ipc backend")
    ap.add_argument("--quant", choices=("fp8",), default=None, help="online quantisation of the bf16 checkpoint")
    ap.add_argument("--checkpoint", choices=("bf16", "fp8-block", "fp8-channel"), default="bf16",
                    help="the checkpoint's format (fp8-block: 128x128 block scales, as DeepSeek-V3 ships; "
                         "fp8-channel: compressed-tensors FP8, per-channel weight scales, dynamic activations)")
    ap.add_argument("--trainer", choices=("same", "bf16"), default="same",
                    help="bf16 (with --checkpoint fp8-block): the trainer holds the bf16 weights, the engine serves "
                         "their block-FP8 quantisation")
    ap.add_argument("--trainer-ckpt", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--torn", action="store_true", help="then a sync aborted mid-way, then a complete one")
    ap.add_argument("--sleep", action="store_true", help="the engine sleeps (level 1) during each trainer step")
    ap.add_argument("--delta", default=None, metavar="FRACTIONS",
                    help="delta sync (trainer and worker); from version 2 on each version changes a fraction of the "
                         "elements, these in turn (e.g. 0.001,0.01,0.05)")
    ap.add_argument("--with-dense", action="store_true",
                    help="with --delta: also a shardsync phase with delta off on the same versions (delta vs dense "
                         "per fraction in the summary)")
    ap.add_argument("--delta-mode", choices=("auto", "always"), default="auto",
                    help="auto: delta where it pays (a colocated worker mapping the trainer's memory reads dense); "
                         "always: the worker reads deltas whatever the link (the GPU codec end to end)")
    ap.add_argument("--no-direct", action="store_true",
                    help="every module on the general path (layerwise buffers + first-load processing)")
    ap.add_argument("--general", action="store_true",
                    help="also a shardsync phase with --no-direct, side by side with the direct path")
    ap.add_argument("--sync-memory", type=int, default=None, metavar="BYTES",
                    help="the sync's memory budget (GroupSettings.sync_memory_bytes; default: min(10%% of the model, "
                         "1 GiB); 0: groups never split)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--phase", choices=("shardsync", "general", "dense", "fresh", "ipc"), default=None)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global CHANGED
    CHANGED = None if args.delta is None else [float(x) for x in args.delta.split(",")]
    if args.phase:
        r = phase(args)
        with open(args.out, "w") as f:
            json.dump(r, f)
        return 0
    work = tempfile.mkdtemp(prefix="gpu-vllm-")
    if args.trainer == "bf16" and (args.checkpoint != "fp8-block" or args.delta is not None):
        ap.error("--trainer bf16 needs --checkpoint fp8-block (and no --delta)")
    ckpt = build_checkpoint(args.model, os.path.join(work, "v0"))
    final = os.path.join(work, f"v{args.syncs}")
    trainer_ckpt = None
    if args.trainer == "bf16":  # the versions are the bf16 trainer's; each checkpoint the engine reads is quantised
        import shutil

        from shardsync.verify.checkpoints import to_block_fp8

        trainer_ckpt = os.path.join(work, "v0-bf16")
        shutil.copytree(ckpt, trainer_ckpt)
        save_version(trainer_ckpt, final, args.syncs, CHANGED)
        to_block_fp8(ckpt)
        to_block_fp8(final)
    else:
        if args.checkpoint == "fp8-block":
            from shardsync.verify.checkpoints import to_block_fp8

            to_block_fp8(ckpt)
        if args.checkpoint == "fp8-channel":
            from shardsync.verify.checkpoints import to_channel_fp8

            to_channel_fp8(ckpt)
        save_version(ckpt, final, args.syncs, CHANGED)
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    if args.checkpoint == "fp8-block":  # the slimmed vLLM on the device lacks DeepGEMM's JIT headers: CUTLASS/Triton
        env.setdefault("VLLM_USE_DEEP_GEMM", "0")
    res: dict = {"model": args.model, "graphs": args.graphs, "quant": args.quant, "checkpoint": args.checkpoint,
                 "trainer": args.trainer, "sleep": args.sleep, "syncs": args.syncs, "delta": args.delta,
                 "delta_mode": args.delta_mode if args.delta is not None else None}
    phases = [("shardsync", ckpt), *([("general", ckpt)] if args.general else []),
              *([("dense", ckpt)] if args.delta is not None and args.with_dense else []), ("fresh", final),
              *([("ipc", ckpt)] if args.baseline and not trainer_ckpt else [])]  # ipc sends what the trainer holds
    for name, path in phases:
        out = os.path.join(work, f"{name}.json")
        cmd = [sys.executable, __file__, "--phase", name, "--ckpt", path, "--out", out, "--syncs", str(args.syncs),
               *(["--graphs"] if args.graphs else []), *(["--quant", args.quant] if args.quant else []),
               *(["--torn"] if args.torn and name == "shardsync" else []),
               *(["--no-direct"] if args.no_direct else []),
               *(["--sync-memory", str(args.sync_memory)] if args.sync_memory is not None else []),
               *(["--trainer-ckpt", trainer_ckpt] if trainer_ckpt and name != "fresh" else []),
               *(["--delta", args.delta, "--delta-mode", args.delta_mode] if args.delta is not None else []),
               *(["--sleep"] if args.sleep and name != "fresh" else [])]
        p = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, timeout=900)
        if p.returncode != 0 or not os.path.exists(out):
            res[name] = {"error": f"exit code {p.returncode}"}
            continue
        with open(out) as f:
            res[name] = json.load(f)
    fresh = res.get("fresh", {})
    for name in ("shardsync", "general", "dense", "ipc"):
        r = res.get(name)
        if not r or "probe" not in r or "probe" not in fresh:
            continue
        mism = compare(r.pop("probe"), fresh["probe"])
        r.pop("tokens_before", None)
        r.update(tensors_compared=len(fresh["probe"]), mismatched=mism[:20], n_mismatched=len(mism),
                 tokens_match=r["tokens"] == fresh["tokens"], exact=not mism and r["tokens"] == fresh["tokens"])
    if "probe" in fresh:
        fresh["tensors"] = len(fresh.pop("probe"))
    res["summary"] = summary(res)
    line = json.dumps(res)
    print(line if args.json else json.dumps(res, indent=1))
    return 0 if res.get("shardsync", {}).get("exact") else 1


if __name__ == "__main__":
    sys.exit(main())
