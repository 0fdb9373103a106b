"""``shardsync bench``: shardsync vs the broadcast baseline, side by side in one run, on this machine.

Producers (PP shares of a model with real HF tensor names and MoE layout, random weights) serve
``replicas × tp`` consumer processes. In the same run we time, after a warm-up, the median of several
syncs of (a) shardsync (pull of each consumer's own slices), (b) the baseline (every full tensor
broadcast to every consumer, loaded by its ordinary loader), and (c) the link's speed of light: the
same transport moving one large buffer between two processes, applied to the bytes shardsync moves.
Every sync of both paths is checked bit-exact against the consumers' own loaders (the baseline's too: a consumer
holds the version the producers broadcast).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time

import torch

from .output import emit_json
from .harness.cluster import LocalCluster
from ..zoo import ZooConfig, hf_state_dict

PRESETS = {
    # Qwen3-MoE naming and structure (GQA, qk-norm, 32 experts/layer), shrunk to fit 2 CPU cores
    "qwen3-moe-bench": ZooConfig.qwen3_moe_tiny(vocab=16000, hidden=768, layers=4, heads=12, kv_heads=4,
                                                head_dim=64, experts=32, moe_inter=256),
    "qwen3-moe-tiny": ZooConfig.qwen3_moe_tiny(layers=4),
    "llama-bench": ZooConfig.llama_tiny(vocab=16000, hidden=1024, layers=6, heads=16, kv_heads=4, head_dim=64,
                                        inter=2816),
}


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


def run_bench_vllm(*, producers: int = 2, replicas: int = 2, tp: int = 2, transport: str = "tcp", syncs: int = 3,
                   arch: str = "qwen3_moe", size: str = "bench", as_json: bool = False) -> dict:
    """Real vLLM consumers: shardsync (workers pull their slices from producer processes) against the
    baseline of every full tensor reaching every worker through ``update_weights`` and vLLM's own
    loaders (what RPC/broadcast-based syncs do), on a tiny checkpoint. The last round of each is compared
    with a FRESH engine started on the same weights (every tensor, probes, tokens)."""
    import os
    import tempfile

    from ..integrations.vllm.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
    from .harness.vllm_engine import VllmReplicas, parallel
    from ..types import dtype_name

    ckpt = build_tiny_checkpoint(arch, os.path.join(tempfile.gettempdir(), "shardsync-bench", f"{arch}-{size}"),
                                 size=size)
    base = load_checkpoint(ckpt)
    model_bytes = sum(t.nbytes for t in base.values())
    print(f"model {arch} ({size}, real vLLM): {model_bytes / 1e6:.2f} MB; {producers} producers -> {replicas} vLLM "
          f"replicas x TP{tp} over {transport}")
    cluster = LocalCluster(None, producers=producers, spec={"kind": "checkpoint", "path": ckpt},
                           external_consumers=replicas * tp, transport=transport, timeout_s=300)
    reps = VllmReplicas(ckpt, replicas=replicas, tp=tp, coordinator=cluster.coordinator, token=cluster.token,
                        transport=transport, timeout_s=300)
    ours, basel, exact = [], [], True
    try:
        reps.init()
        cluster.wait_ready()
        v = 0
        for i in range(syncs + 1):
            v += 1
            t0 = time.perf_counter()
            parallel([lambda: cluster.sync(v), lambda: reps.sync(v)])
            t_ours = time.perf_counter() - t0
            per = [s["bytes_received"] for s in reps.status()]
            if i == syncs:
                ok, bad, _ = reps.check_against_fresh(perturb(base, v), tag="-ours")
                exact &= ok
                if bad:
                    print(f"  shardsync v{v} differs from a fresh engine: {bad[:5]}", file=sys.stderr)
            v += 1
            full = perturb(base, v)
            upd = {"op": "full", "version": v, "tensors": [[n, dtype_name(t.dtype), list(t.shape),
                                                            t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()]
                                                           for n, t in full.items()]}
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
    finally:
        reps.close()
        cluster.close()
    s_, b_ = statistics.median(ours), statistics.median(basel)
    out = {"model": arch, "consumers_kind": "vllm", "model_bytes": model_bytes, "consumers": replicas * tp,
           "shardsync_s": round(s_, 4), "baseline_s": round(b_, 4), "speedup_vs_baseline": round(b_ / s_, 2),
           "bytes_per_consumer": per, "gbps": round(sum(per) / s_ / 1e9, 4), "exact": bool(exact)}
    print(f"shardsync {s_:.3f} s, baseline {b_:.3f} s: {b_ / s_:.2f}x; equal to a fresh engine: {'yes' if exact else 'NO'}")
    if as_json:
        emit_json(out)
    return out
