"""``shardsync bench``: shardsync against the baselines on this machine, side by side in one run; four modes.

- default (:func:`run_bench`): producers (PP shares of a model with real HF tensor names and MoE layout, random
  weights) serve ``replicas × tp`` zoo consumer processes. After a warm-up, the median of several syncs of (a)
  shardsync (each consumer pulls its own slices), (b) the broadcast baseline (``programs/baseline.py``: every full
  tensor to every consumer, loaded by its ordinary loader) and (c) the link's speed of light (the same transport
  moving one large buffer between two processes, applied to the bytes shardsync moves). Every sync of both paths
  is checked bit-exact against the consumers' own loaders (a baseline consumer holds the version broadcast).
- ``--consumers vllm`` (:func:`run_bench_vllm`): real vLLM replicas; the baseline is every full tensor through
  ``update_weights`` and vLLM's own loaders; the last round of each equals a FRESH engine on the same weights.
- ``--mode v1|v2|v3|v4|all`` (:func:`run_bench_modes`): the trainer-side export step by step. A TP2·PP2·EP2
  Megatron-style trainer (8 producer processes, gloo) serves one TP2 zoo replica; every sync checked byte for byte:

    v1  gather everything everywhere, tensor by tensor: every rank materialises EVERY tensor of the model with
        one all-gather per Megatron tensor over the whole trainer world (``harness.trainers.GatherEverywhere``);
        any rank may serve anything. lookahead 0, consumers pull group by group, producer after producer.
    v2  PP-local + EP-local gathers (``MegatronSource``: TP-only collectives, one per group), lookahead 0, serial
    v3  v2 + pipelined gathers (lookahead 1: gather group g+1 while g is pulled), serial pulls
    v4  v3 + every PP stage at once (one puller per producer: ``parallel_producers=True``)

  ``s`` is the sync's own time: the max over producers and consumers of their ``seconds`` (a producer's from its
  first gather to every release; a consumer's from its BeginSync to its last apply), the median over ``syncs``
  syncs after one warm-up. ``wall_s``: the same median of ``LocalCluster.sync``'s wall time (adds the training
  step and every consumer's byte check). ``peak_gathered_bytes``: the most full tensors one producer held at once.
- ``--ray`` (:func:`run_ray_bench`): the trainer and engines as Ray actors (2 trainers, PP2 -> ``replicas`` x TP
  ``tp`` zoo engines), once per transport — ``tcp``, ``nixl`` against Ray Direct Transport (``rdt``); every engine
  checked byte for byte after the last sync.

    shardsync bench --model qwen3-moe-tiny --replicas 1     # small
    shardsync bench --mode all --json                        # the JSON alone on stdout: {"modes": {...}}
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

from ..testing.harness.cluster import LocalCluster
from ..testing.harness.hosts import free_port
from ..verify.output import emit_json
from ..testing.zoo import ZooConfig, hf_state_dict

__all__ = ["PRESETS", "MODES", "run_bench", "run_bench_vllm", "run_bench_modes", "run_ray_bench", "run"]

PRESETS = {
    # Qwen3-MoE naming and structure (GQA, qk-norm, 32 experts/layer), shrunk to fit 2 CPU cores
    "qwen3-moe-bench": ZooConfig.qwen3_moe_tiny(vocab=16000, hidden=768, layers=4, heads=12, kv_heads=4,
                                                head_dim=64, experts=32, moe_inter=256),
    "qwen3-moe-tiny": ZooConfig.qwen3_moe_tiny(layers=4),
    "llama-bench": ZooConfig.llama_tiny(vocab=16000, hidden=1024, layers=6, heads=16, kv_heads=4, head_dim=64,
                                        inter=2816),
}


MODES = {  # mode -> (gather, lookahead, parallel_producers, what)
    "v1": ("everywhere", 0, False, "all tensors on all ranks, one world collective per tensor"),
    "v2": ("local", 0, False, "PP/EP-local gathers (TP collective per group)"),
    "v3": ("local", 1, False, "v2 + pipelined gathers (lookahead 1)"),
    "v4": ("local", 1, True, "v3 + all PP stages in parallel"),
}
PAR = {"tp": 2, "pp": 2, "ep": 2}


def _raw_server(q, n: int, transport: str) -> None:
    from ..transport import make_transport

    t = make_transport(transport, **({"host": "127.0.0.1"} if transport == "tcp" else {}))
    q.put(t.register(torch.ones(n, dtype=torch.uint8)))
    q.get(timeout=120)


def link_bandwidth(transport: str, nbytes: int = 128 << 20, reps: int = 3) -> float:
    """Bytes/s of one large read between two processes over ``transport`` (the speed of light here)."""
    from ..transport import make_transport

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_raw_server, args=(q, nbytes, transport), daemon=True)
    p.start()
    try:
        t = make_transport(transport, **({"host": "127.0.0.1"} if transport == "tcp" else {}))
        t.connect(0, q.get(timeout=60))
        into = torch.empty(nbytes, dtype=torch.uint8)
        t.read(0, 0, nbytes, into, timeout_s=60)  # warm-up
        best = []
        for _ in range(reps):
            t0 = time.perf_counter()
            t.read(0, 0, nbytes, into, timeout_s=60)
            best.append(time.perf_counter() - t0)
        t.close()
        return nbytes / min(best)
    finally:
        q.put(None)
        p.join(10)


def _seconds(r: dict) -> float:
    return max([p["seconds"] for p in r["producers"]] + [c["seconds"] for c in r["consumers"]])


def run_bench(*, model: str = "qwen3-moe-bench", producers: int = 2, replicas: int = 2, tp: int = 2,
              transport: str = "tcp", syncs: int = 3, as_json: bool = False) -> dict:
    cfg = PRESETS[model]
    model_bytes = sum(t.nbytes for t in hf_state_dict(cfg).values())
    n_cons = replicas * tp
    print(f"model {model}: {model_bytes / 1e6:.1f} MB; {producers} producers -> {replicas} replicas x TP{tp} "
          f"({n_cons} consumers) over {transport}")
    bw = link_bandwidth(transport)
    print(f"link speed of light ({transport}, 128 MiB between two processes): {bw / 1e9:.2f} GB/s")
    ours, base, per_consumer = [], [], []
    exact = {"shardsync": True, "baseline": True}  # every sync of each path, checked byte for byte
    with LocalCluster(cfg, producers=producers, replicas=replicas, tp=tp, transport=transport, baseline=True,
                      max_chunk_bytes=8 << 20, timeout_s=300) as cl:
        v = 0
        for i in range(syncs + 1):  # first round is warm-up
            v += 1
            r = cl.sync(v)
            exact["shardsync"] &= r["exact"]
            per_consumer = [c["bytes_received"] for c in r["consumers"]]
            v += 1
            b = cl.sync(v, baseline=True)
            exact["baseline"] &= b["exact"]
            if i:
                ours.append(_seconds(r))
                base.append(_seconds(b))
            print(f"  round {i}{' (warm-up)' if not i else ''}: shardsync {_seconds(r):.3f} s, "
                  f"baseline {_seconds(b):.3f} s, exact {r['exact'] and b['exact']}")
    s, bl = statistics.median(ours), statistics.median(base)
    moved = sum(per_consumer)
    sol = moved / bw
    out = {"model": model, "model_bytes": model_bytes, "consumers": n_cons, "producers": producers,
           "transport": transport, "shardsync_s": round(s, 4), "baseline_s": round(bl, 4),
           "speedup_vs_baseline": round(bl / s, 2), "bytes_per_consumer": per_consumer,
           "gbps": round(moved / s / 1e9, 3), "link_gbps": round(bw / 1e9, 3), "sol_s": round(sol, 4),
           "sol_ratio": round(sol / s, 3), "baseline_bytes": model_bytes * n_cons, "exact": all(exact.values()),
           "shardsync_exact": exact["shardsync"], "baseline_exact": exact["baseline"]}
    print(f"{'':<12}{'seconds':>10}{'GB moved':>10}{'vs SoL':>9}{'speedup':>9}")
    print(f"{'SoL':<12}{sol:>10.3f}{moved / 1e9:>10.3f}{1:>9.2f}{'':>9}")
    print(f"{'shardsync':<12}{s:>10.3f}{moved / 1e9:>10.3f}{sol / s:>9.2f}{bl / s:>8.2f}x")
    print(f"{'baseline':<12}{bl:>10.3f}{model_bytes * n_cons / 1e9:>10.3f}{sol / bl:>9.2f}{1:>8.2f}x")
    print(f"bit-exact: {'yes' if all(exact.values()) else 'NO'} ("
          + ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, ok in exact.items()) + ")")
    if as_json:
        emit_json(out)
    return out


def replica_paths(paths: str, replicas: int) -> list[bool]:
    """Per replica, whether it writes directly (``--paths``): ``both`` alternates, even replicas direct."""
    if paths not in ("both", "direct", "general"):
        raise ValueError(f"paths={paths!r}: expected both, direct or general")
    if paths == "both" and replicas < 2:
        raise ValueError(f"paths='both' needs at least 2 replicas (one per path), got {replicas}")
    return [i % 2 == 0 if paths == "both" else paths == "direct" for i in range(replicas)]


def run_bench_vllm(*, producers: int = 2, replicas: int = 2, tp: int = 2, transport: str = "tcp", syncs: int = 3,
                   arch: str = "qwen3_moe", size: str = "bench", paths: str = "both", as_json: bool = False) -> dict:
    """``--consumers vllm``: shardsync (workers pull their slices from producer processes) against the
    baseline of every full tensor reaching every worker through ``update_weights`` and vLLM's own
    loaders (what RPC/broadcast-based syncs do), on a tiny checkpoint. The last round of each is compared
    with a FRESH engine started on the same weights (every tensor, probes, tokens).

    ``paths``: ``both`` (even replicas write directly where the init check allows, odd ones take the general path:
    layerwise buffers and first-load processing replay for every module; each path's update window, and the part of
    it its apply thread spent scattering and processing, timed in the same rounds: the pulls share the producers, so
    the windows differ by what applying costs), ``direct`` or ``general`` (every replica)."""
    import os
    import tempfile

    from ..verify.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
    from ..testing.harness.vllm_replica import full_update, parallel, vllm_cluster

    direct = replica_paths(paths, replicas)  # a bad choice is refused before any engine starts

    ckpt = build_tiny_checkpoint(arch, os.path.join(tempfile.gettempdir(), "shardsync-bench", f"{arch}-{size}"),
                                 size=size)
    base = load_checkpoint(ckpt)
    model_bytes = sum(t.nbytes for t in base.values())
    print(f"model {arch} ({size}, real vLLM): {model_bytes / 1e6:.2f} MB; {producers} producers -> {replicas} vLLM "
          f"replicas x TP{tp} over {transport}")
    ours, basel, exact = [], [], True
    timed: dict[str, list[tuple[float, float]]] = {"direct": [], "general": []}  # path -> (window, apply) a round
    with vllm_cluster(ckpt, producers=producers, replicas=replicas, tp=tp, transport=transport,
                      direct=direct) as (cluster, reps):
        v = 0
        for i in range(syncs + 1):
            v += 1
            t0 = time.perf_counter()
            parallel([lambda: cluster.sync(v), lambda: reps.sync(v)])
            t_ours = time.perf_counter() - t0
            st = reps.status()
            per = [s["bytes_received"] for s in st]
            if i:  # each replica's update window and apply time (its slowest worker's), by path
                for r, d in enumerate(direct):
                    workers = st[r * tp:(r + 1) * tp]
                    timed["direct" if d else "general"].append((max(w.get("seconds", 0.0) for w in workers),
                                                                max(w.get("apply_s", 0.0) for w in workers)))
            if i == syncs:
                ok, bad, _ = reps.check_against_fresh(perturb(base, v), tag="-ours")
                exact &= ok
                if bad:
                    print(f"  shardsync v{v} differs from a fresh engine: {bad[:5]}", file=sys.stderr)
            v += 1
            full = perturb(base, v)
            upd = full_update(v, full)
            t0 = time.perf_counter()
            reps.sync(v, upd)
            t_base = time.perf_counter() - t0
            if i == syncs:
                ok, bad, _ = reps.check_against_fresh(full, tag="-baseline")
                exact &= ok
                if bad:
                    print(f"  baseline v{v} differs from a fresh engine: {bad[:5]}", file=sys.stderr)
            if i:
                ours.append(t_ours)
                basel.append(t_base)
            print(f"  round {i}{' (warm-up)' if not i else ''}: shardsync {t_ours:.3f} s, baseline {t_base:.3f} s")
    s_, b_ = statistics.median(ours), statistics.median(basel)
    modules = {("direct" if d else "general"): [st[r * tp].get(k) for k in ("direct_modules", "general_modules")]
               for r, d in enumerate(direct)}  # the last round's workers (the same every round)
    out = {"model": arch, "consumers_kind": "vllm", "model_bytes": model_bytes, "consumers": replicas * tp,
           "shardsync_s": round(s_, 4), "baseline_s": round(b_, 4), "speedup_vs_baseline": round(b_ / s_, 2),
           "bytes_per_consumer": per, "gbps": round(sum(per) / s_ / 1e9, 4), "exact": bool(exact),
           "paths": {k: {"window_s": round(statistics.median(w for w, _ in rounds), 4),
                         "apply_s": round(statistics.median(a for _, a in rounds), 4),
                         "direct_modules_per_worker": modules[k][0], "general_modules_per_worker": modules[k][1]}
                     for k, rounds in timed.items() if rounds}}
    print(f"shardsync {s_:.3f} s, baseline {b_:.3f} s: {b_ / s_:.2f}x; equal to a fresh engine: "
          f"{'yes' if exact else 'NO'}")
    for k, r in out["paths"].items():
        print(f"  {k} path: update window {r['window_s']:.3f} s, applying {r['apply_s']:.3f} s of it (medians, "
              "slowest worker), "
              f"modules per worker: {r['direct_modules_per_worker']} written directly, "
              f"{r['general_modules_per_worker']} on the general path")
    if as_json:
        emit_json(out)
    return out


# ---------------------------------------------------------------- --mode: the trainer-side export, step by step
def bench_config() -> ZooConfig:
    """Qwen3-MoE naming and structure (GQA, qk-norm, 8 experts/layer), ~18 MB: 8 trainer processes on 2 cores."""
    return ZooConfig.qwen3_moe_tiny(vocab=1000, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=8,
                                    moe_inter=128, ckpt_dtype="float32", dtype="float32")


def run_mode(mode: str, cfg: ZooConfig, *, syncs: int = 3, transport: str = "tcp") -> dict:
    """One cluster for ``mode``: a warm-up sync, then ``syncs`` timed syncs with new weights each."""
    gather, lookahead, parallel, _ = MODES[mode]
    spec = {"kind": "megatron", "cfg": cfg.__dict__, "par": PAR, "dist_port": free_port()}
    if gather == "everywhere":
        spec["gather"] = "everywhere"
    n = PAR["tp"] * PAR["pp"] * PAR["ep"]
    wall, own, peak, exact, pulled, resident = [], [], 0, True, 0, 0
    with LocalCluster(cfg, producers=n, replicas=1, tp=2, spec=spec, lookahead=lookahead, transport=transport,
                      max_chunk_bytes=64 << 10, timeout_s=120,
                      consumer_extra={"parallel_producers": parallel}) as cl:
        for v in range(1, syncs + 2):
            t0 = time.perf_counter()
            r = cl.sync(v)
            dt = time.perf_counter() - t0
            secs = max(x["seconds"] for x in r["producers"] + r["consumers"])
            exact &= bool(r["exact"])
            peak = max([peak] + [p["peak_gathered_bytes"] for p in r["producers"]])
            pulled = max(len(c.get("pulled_from", ())) for c in r["consumers"])
            resident = max([resident] + [p["max_resident"] for p in r["producers"]])
            print(f"  {mode} sync {v}{' (warm-up)' if v == 1 else ''}: {dt:.3f} s wall, {secs:.3f} s sync, "
                  f"exact {r['exact']}", file=sys.stderr)
            if v > 1:
                wall.append(dt)
                own.append(secs)
    return {"s": round(statistics.median(own), 4), "wall_s": round(statistics.median(wall), 4),
            "peak_gathered_bytes": int(peak), "exact": bool(exact), "lookahead": lookahead,
            "parallel_producers": parallel, "pulled_from": pulled, "max_resident": resident}


def run_bench_modes(mode: str = "all", *, syncs: int = 3, transport: str = "tcp", as_json: bool = False) -> dict:
    """``--mode``: each mode's cluster in turn; the table (and the JSON)."""
    modes = list(MODES) if mode == "all" else [mode]
    cfg = bench_config()
    print(f"bench modes {', '.join(modes)}: Megatron TP{PAR['tp']}·PP{PAR['pp']}·EP{PAR['ep']} trainer "
          f"({PAR['tp'] * PAR['pp'] * PAR['ep']} producers) -> 1 TP2 zoo replica; qwen3-moe zoo "
          f"layers={cfg.layers} experts={cfg.experts} hidden={cfg.hidden} {cfg.ckpt_dtype}; {syncs} timed syncs "
          f"after 1 warm-up, over {transport}")
    res = {}
    for m in modes:
        res[m] = run_mode(m, cfg, syncs=syncs, transport=transport)
    print(f"{'mode':<5}{'sync s':>9}{'wall s':>9}{'peak gathered B':>17}{'resident':>9}{'exact':>7}  what")
    for m, r in res.items():
        print(f"{m:<5}{r['s']:>9.3f}{r['wall_s']:>9.3f}{r['peak_gathered_bytes']:>17,}{r['max_resident']:>9}"
              f"{str(r['exact']):>7}  {MODES[m][3]}")
    out = {"modes": res}
    if as_json:
        emit_json(out)
    return out


# ---------------------------------------------------------------- --ray
def run_ray_bench(*, model: str = "qwen3-moe-bench", replicas: int = 2, tp: int = 2, syncs: int = 3,
                  transports: tuple[str, ...] = ("tcp", "nixl", "rdt"), as_json: bool = False) -> dict[str, Any]:
    """``--ray``: per transport, a warm-up sync then ``syncs`` timed ones (the slowest producer's seconds)."""
    import ray

    from ..testing.harness.ray_actors import TrainerRank, ZooEngine, close_actors

    cfg = asdict(PRESETS[model])
    spec = {"kind": "zoo", "cfg": cfg}
    own = not ray.is_initialized()
    if own:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="shardsync-bench")
    out: dict[str, Any] = {"model": model, "replicas": replicas, "tp": tp, "syncs": syncs, "transports": {}}
    try:
        for t in transports:
            group = f"bench-{t}"
            trainers = [TrainerRank.remote(spec, r, 2, group=group, n_consumers=replicas * tp, transport=t,
                                           timeout_s=300, lease_s=30) for r in range(2)]
            engines = [ZooEngine.remote(f"r{i}/tp{k}", cfg, tp, k, group=group, timeout_s=300)
                       for i in range(replicas) for k in range(tp)]
            try:
                ray.get([a.init.remote() for a in trainers + engines], timeout=600)
                times, got = [], 0
                for v in range(1, syncs + 2):
                    refs = [a.sync.remote(v) for a in trainers] + [e.sync.remote(v) for e in engines]
                    res = ray.get(refs, timeout=600)
                    if v > 1:
                        times.append(max(r["seconds"] for r in res[:2]))
                    got = sum(r.get("bytes_received", 0) for r in res[2:])
                checks = ray.get([e.check.remote() for e in engines], timeout=600)
                out["transports"][t] = {"seconds": statistics.median(times), "all_s": [round(x, 4) for x in times],
                                        "bytes_per_sync": got,
                                        "exact": all(c["mismatched"] == [] for c in checks)}
            finally:
                close_actors(engines + trainers, group, timeout_s=30, kill=True)
            r = out["transports"][t]
            print(f"  {t:<5} median {r['seconds']:.4f} s {r['all_s']}  {r['bytes_per_sync'] / r['seconds'] / 1e9:.3f} "
                  f"GB/s  exact={r['exact']}", flush=True)
    finally:
        if own:
            ray.shutdown()
    best = min(out["transports"], key=lambda k: out["transports"][k]["seconds"])
    out["fastest"] = best
    out["exact"] = all(r["exact"] for r in out["transports"].values())
    out["vs_rdt"] = {k: out["transports"]["rdt"]["seconds"] / r["seconds"] for k, r in out["transports"].items()} \
        if "rdt" in out["transports"] else {}
    print(f"fastest inside Ray: {best}; speed vs rdt: " + ", ".join(f"{k} {x:.2f}x" for k, x in out["vs_rdt"].items()))
    if as_json:
        emit_json(out)
    return out


def run(args) -> int:
    """``shardsync bench``: 0 when every sync of every path was exact."""
    if args.delta:
        from .bench_delta import run_bench_delta

        return 0 if run_bench_delta(params=args.params, syncs=args.syncs, lr=args.lr, replicas=args.replicas or 1,
                                    tp=args.tp or 1, transport=args.transport, as_json=args.json)["exact"] else 1
    args.replicas, args.tp = args.replicas or 2, args.tp or 2
    if args.ray:
        return 0 if run_ray_bench(model=args.model, replicas=args.replicas, tp=args.tp, syncs=args.syncs,
                                  as_json=args.json)["exact"] else 1
    if args.mode:
        r = run_bench_modes(args.mode, syncs=args.syncs, transport=args.transport, as_json=args.json)
        return 0 if all(x["exact"] for x in r["modes"].values()) else 1
    if args.consumers == "vllm":
        r = run_bench_vllm(producers=args.producers, replicas=args.replicas, tp=args.tp, transport=args.transport,
                           syncs=args.syncs, paths=args.paths, as_json=args.json)
    else:
        r = run_bench(model=args.model, producers=args.producers, replicas=args.replicas, tp=args.tp,
                      transport=args.transport, syncs=args.syncs, as_json=args.json)
    return 0 if r["exact"] else 1
