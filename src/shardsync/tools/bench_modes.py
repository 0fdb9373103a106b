"""``shardsync bench --mode v1|v2|v3|v4|all``: the trainer-side export, step by step, on a Megatron trainer.

A TP2·PP2·EP2 Megatron-style trainer (8 producer processes, gloo, Megatron layouts of a Qwen3-MoE zoo model)
serves one TP2 zoo replica (2 consumer processes), all through the product's own Producer/Consumer; every
sync is checked byte for byte by the consumers. Modes, each one step on the one before:

    v1  gather everything everywhere, tensor by tensor: every rank materialises EVERY tensor of the model with
        one all-gather per Megatron tensor over the whole trainer world (``harness.trainers.GatherEverywhere``);
        any rank may serve anything. lookahead 0, consumers pull group by group, producer after producer.
    v2  PP-local + EP-local gathers (``MegatronSource``: TP-only collectives, one per group), lookahead 0, serial
    v3  v2 + pipelined gathers (lookahead 1: gather group g+1 while g is pulled), serial pulls
    v4  v3 + every PP stage at once (one puller per producer: ``parallel_producers=True``)

    shardsync bench --mode all            # table: median sync seconds, peak gathered bytes, exact
    shardsync bench --mode v2 --json      # the JSON alone on stdout: {"modes": {"v2": {"s": ..., ...}}}

``s`` is the sync's own time: the max over producers and consumers of their ``seconds`` (a producer's from
its first gather to every release; a consumer's from its BeginSync to its last apply), the median over
``syncs`` syncs after one warm-up sync. ``wall_s`` is the same median of ``LocalCluster.sync``'s wall time,
which adds the training step (new weights on every rank) and every consumer's byte-for-byte check.
``peak_gathered_bytes`` is the largest, over producers, of the full tensors one producer held at once.
"""

from __future__ import annotations

import socket
import statistics
import sys
import time

from .harness.cluster import LocalCluster
from .output import emit_json
from ..zoo import ZooConfig

MODES = {  # mode -> (gather, lookahead, parallel_producers, what)
    "v1": ("everywhere", 0, False, "all tensors on all ranks, one world collective per tensor"),
    "v2": ("local", 0, False, "PP/EP-local gathers (TP collective per group)"),
    "v3": ("local", 1, False, "v2 + pipelined gathers (lookahead 1)"),
    "v4": ("local", 1, True, "v3 + all PP stages in parallel"),
}
PAR = {"tp": 2, "pp": 2, "ep": 2}


def bench_config() -> ZooConfig:
    """Qwen3-MoE naming and structure (GQA, qk-norm, 8 experts/layer), ~18 MB: 8 trainer processes on 2 cores."""
    return ZooConfig.qwen3_moe_tiny(vocab=1000, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=8,
                                    moe_inter=128, ckpt_dtype="float32", dtype="float32")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(mode: str, cfg: ZooConfig, *, syncs: int = 3, transport: str = "tcp") -> dict:
    """One cluster for ``mode``: a warm-up sync, then ``syncs`` timed syncs with new weights each."""
    gather, lookahead, parallel, _ = MODES[mode]
    spec = {"kind": "megatron", "cfg": cfg.__dict__, "par": PAR, "dist_port": _port()}
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
