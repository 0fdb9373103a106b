"""GPU benchmark of the engine a user runs: ``Producer`` on GPU0, ``Consumer``s on GPU1, through the coordinator
and the control plane, for Qwen3-30B-A3B-shaped weights (two H200s).

Every number comes from one run (median of ``--iters`` syncs after two warm-up syncs — the first builds the
packers' and unpackers' views; it is reported as ``first_sync_s``):

* A — one producer (the whole model) -> one TP1 consumer whose ``apply`` is vLLM's loader semantics (zoo) plus
  the FP8 process step (128x128 block scales, one fused Triton kernel, in place): the engine over each transport
  (``cuda_ipc``, ``nccl``, ``nixl`` if installed); beside it, in the same processes, the speed of light (plan
  bytes / a raw GPU0->GPU1 copy), the floor (the plan's groups copied back to back with no control plane, no
  pack and no apply: what a pipeline could reach at best at this granularity) and the baselines
  (``shardsync.programs.baseline``, the one ``shardsync bench`` times: per-tensor and 1 GiB bucketed NCCL broadcast,
  each followed by the loader and the process step).
* B — one producer -> a TP2 replica whose two consumers share GPU1: the engine (each pulls its slices) vs the
  same engine where each consumer's plan is every full tensor and its loader keeps its share ("full pull").
* C — two producers on GPU0, each holding half the layers (PP2) -> one consumer: both stages served at once.

Correctness, per transport: before the last sync the trainer's weights change (new seed) and the consumers'
parameters and FP8 tensors are poisoned; after it each consumer compares, layer by layer, every byte with what
its loaders + the same process step give on the full tensors. The baselines' last rounds are checked the same way.

    python benchmarks/gpu_sync.py --out $OUT                       # full model, two ~140 GB GPUs
    python benchmarks/gpu_sync.py --device cpu --layers 2 --experts 4   # the same harness on CPU (tcp, nccl:gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_procs, in this process and its children
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts

import torch  # noqa: E402

from shardsync.testing.harness.hosts import Hosted, results  # noqa: E402

PROCS = "gpu_procs"
"""The module of the scenario's processes (beside this file)."""


# ------------------------------------------------------------------------------------------------ driver
class Group:
    """The processes of one scenario (``harness.hosts.Hosted``: a ``gpu_procs.GpuProducer`` per producer, a
    ``GpuConsumer`` per consumer) and the syncs it runs; a dead child fails the wait at once, naming it."""

    def __init__(self, args, producers: int, consumers: list[tuple[str, int, int, bool]], bcast: bool):
        self.hosts: dict = {}
        for r in range(producers):
            self.hosts[r] = Hosted(f"producer{r}", f"{PROCS}:GpuProducer",
                                   dict(rank=r, n=producers, args=args, bcast_world=bcast and r == 0), daemon=True)
        for cid, tp, rank, full_pull in consumers:
            self.hosts[cid] = Hosted(cid, f"{PROCS}:GpuConsumer", dict(cid=cid, tp=tp, rank=rank, full_pull=full_pull,
                                                                       args=args, bcast_world=bcast), daemon=True)
        self.producers = list(range(producers))
        self.consumers = [c[0] for c in consumers]
        self.wait({k: h.constructor for k, h in self.hosts.items()}, 1800)

    def wait(self, calls: dict, timeout_s: float = 900) -> dict:
        got = results(calls, timeout_s)
        bad = {k: v for k, v in got.items() if isinstance(v, BaseException)}
        if bad:
            raise RuntimeError("; ".join(f"{k}: {type(v).__name__}: {v}" for k, v in bad.items()))
        return got

    def call(self, who, method: str, *args, timeout_s: float = 900) -> dict:
        return self.wait({w: self.hosts[w].call(method, *args) for w in who}, timeout_s)

    def setup(self, transport: str) -> dict:
        coord = self.call([0], "setup", transport, None, len(self.consumers))[0]
        inits = {0: self.hosts[0].call("init")}  # waits for every consumer's plan
        self.call(self.producers[1:], "setup", transport, coord, len(self.consumers))
        inits.update({r: self.hosts[r].call("init") for r in self.producers[1:]})
        inits.update({c: self.hosts[c].call("setup", transport, coord) for c in self.consumers})
        return self.wait(inits, 1800)

    def sync(self, v: int) -> tuple[float, dict]:
        r = self.call(self.producers + self.consumers, "sync", v)
        return max(x["seconds"] for x in r.values()), r

    def run_engine(self, transport: str, iters: int, v0: int) -> dict:
        """Two warm-up syncs (the first builds the views) + ``iters`` timed syncs; then new weights, poisoned
        consumers, one more sync, byte check."""
        ready = self.setup(transport)
        self.call(self.producers, "reseed", 1)
        cold, _ = self.sync(v0)  # builds the packers' and unpackers' views (kept from the second sync on)
        self.sync(v0 + 1)
        times, last = [], {}
        for i in range(iters):
            t, last = self.sync(v0 + 2 + i)
            times.append(t)
        self.call(self.producers, "reseed", 2)
        self.call(self.consumers, "poison")
        self.sync(v0 + 2 + iters)
        checked = self.call(self.consumers, "check", 2, timeout_s=1800)
        self.call(self.producers + self.consumers, "teardown")
        return {"seconds": statistics.median(times), "all_s": [round(t, 4) for t in times], "first_sync_s": cold,
                "exact": all(c["exact"] for c in checked.values()), "checked": checked,
                "ready": {str(k): v for k, v in ready.items()}, "last": {str(k): v for k, v in last.items()}}

    def bcast(self, mode: str, iters: int, seed: int = 3) -> tuple[float, dict]:
        """The broadcast baseline: a warm-up + ``iters`` timed rounds; before the last one the trainer's weights
        change (``seed``) and the consumers are poisoned; afterwards the same byte check as the engine's."""
        ts = []
        for i in range(iters + 1):
            if i == iters:
                self.call(self.producers, "reseed", seed)
                self.call(self.consumers, "poison")
            r = self.call([0] + self.consumers, "bcast", mode, timeout_s=1800)
            ts.append(max(x["seconds"] for x in r.values()))
        return statistics.median(ts[1:]), self.call(self.consumers, "check", seed, timeout_s=1800)

    def close(self) -> None:
        for h in self.hosts.values():
            h.close(30)

    def kill(self) -> None:
        for h in self.hosts.values():
            h.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--moe-inter", type=int, default=0, help="expert FFN width (the scaling table: 4x the experts at "
                                                            "1/4 the width moves the same bytes in 4x the tensors)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--port", type=int, default=29513)
    ap.add_argument("--chunk-mb", type=int, default=1024, help="ProducerConfig.max_chunk_bytes in MiB")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--recv-slots", type=int, default=4)
    ap.add_argument("--transports", default="", help="comma list (default: cuda_ipc,nccl[,nixl] on GPUs; "
                                                     "tcp,nccl:gloo on CPU)")
    ap.add_argument("--scenarios", default="ABC")
    ap.add_argument("--no-process", action="store_true", help="no FP8 process step in the consumers' apply (the engine "
                                                                   "alone against the floor)")
    ap.add_argument("--profile", action="store_true", help="cProfile every sync into OUT/profile-*.txt")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "gpu_sync.log"), "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    if args.transports:
        transports = args.transports.split(",")
    elif args.device == "cpu":
        transports = ["tcp", "nccl:gloo"]
    else:
        transports = ["cuda_ipc", "nccl"]
        try:
            import nixl  # noqa: F401
            transports.append("nixl")
        except ImportError:
            log("nixl not installed: no nixl rows")
    log(f"gpu_sync {time.strftime('%Y-%m-%d %H:%M:%S')} device={args.device} "
        f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'} transports={transports}")
    summary: dict = {"transports": transports, "command": " ".join(sys.argv)}
    # NCCL refuses two ranks of one communicator on one GPU: with a single GPU the broadcast baselines are left out
    bcast = not (args.device == "cuda" and torch.cuda.device_count() < 2)
    if not bcast:
        summary["baselines"] = "left out: one GPU (NCCL cannot put the broadcast's two ranks on one device)"
        log(f"  {summary['baselines']}")
    groups: list[Group] = []
    try:
        if "A" in args.scenarios:
            g = Group(args, 1, [("tp0", 1, 0, False)], bcast=bcast)
            groups.append(g)
            a: dict = {}
            a["link"] = g.call(["tp0"], "link")["tp0"]
            a["engine"] = {}
            for i, t in enumerate(transports):
                a["engine"][t] = g.run_engine(t, args.iters, 1 + 100 * i)
                log(f"  A engine {t:<10}: median {a['engine'][t]['seconds']:.4f} s {a['engine'][t]['all_s']} "
                    f"exact={a['engine'][t]['exact']}; last sync: {stages(a['engine'][t]['last'])}")
            a["baseline_checked"] = {}
            for mode, what in (("bucket", "bucketed 1 GiB"), ("tensor", "per-tensor")) if bcast else ():
                a[f"bcast_{mode}_s"], a["baseline_checked"][mode] = g.bcast(mode, args.iters)
                log(f"  A {what} broadcast: {a[f'bcast_{mode}_s']:.4f} s "
                    f"exact={all(c['exact'] for c in a['baseline_checked'][mode].values())}")
            a["plan_bytes"] = a["engine"][transports[0]]["ready"]["tp0"]["plan_bytes"]
            g.close()
            summary["A"] = report_a(a, log)
        if "B" in args.scenarios:
            b: dict = {}
            for mode, full in (("sliced", False), ("full_pull", True)):
                g = Group(args, 1, [(f"tp{r}", 2, r, full) for r in range(2)], bcast=False)
                groups.append(g)
                b[mode] = {t: g.run_engine(t, args.iters, 1 + 100 * i) for i, t in enumerate(transports)}
                g.close()
            summary["B"] = report_b(b, summary.get("A"), log)
        if "C" in args.scenarios:
            g = Group(args, 2, [("tp0", 1, 0, False)], bcast=False)
            groups.append(g)
            c = {t: g.run_engine(t, args.iters, 1 + 100 * i) for i, t in enumerate(transports)}
            g.close()
            summary["C"] = report_c(c, summary.get("A"), log)
    finally:
        for g in groups:
            g.kill()
    json.dump(summary, open(os.path.join(args.out, "gpu_sync.json"), "w"), indent=1, default=str)
    log(json.dumps(headline(summary), default=str))


def stages(last: dict) -> str:
    """Where a sync's host time went, per process (producer: waiting for a ring slot, gathering, packing;
    consumer: waiting for Ready, reading, applying)."""
    keys = ("cpu_s", "slot_wait_s", "gather_s", "pack_s", "ready_wait_s", "read_s", "apply_s")
    return "; ".join(f"{who}: " + ", ".join(f"{k[:-2]} {r[k]:.3f}" for k in keys if k in r) for who, r in last.items())


def report_a(a: dict, log) -> dict:
    gbps, floor = a["link"]["p2p_gbps"], a["link"]["floor_s"]
    sol = a["plan_bytes"] / (gbps * 1e9)
    best = min(a["engine"], key=lambda t: a["engine"][t]["seconds"])
    log(f"\nscenario A: 1 producer GPU0 -> 1 consumer TP1 GPU1, +fp8 process; plan {a['plan_bytes'] / 1e9:.2f} GB, "
        f"p2p {gbps:.1f} GB/s")
    log(f"{'':<44}{'seconds':>9}{'SoL/t':>8}{'vs per-tensor':>15}{'vs bucketed':>13}")
    rows = [("speed of light (plan bytes / p2p copy)", sol),
            ("floor: groups copied back to back", floor),
            *[(f"shardsync engine, {t}", a["engine"][t]["seconds"]) for t in a["engine"]],
            *[(f"baseline: {w} bcast + load", a[k]) for w, k in (("bucketed 1 GiB", "bcast_bucket_s"),
                                                                 ("per-tensor", "bcast_tensor_s")) if k in a]]
    nan = float("nan")
    tb, bb = a.get("bcast_tensor_s", nan), a.get("bcast_bucket_s", nan)
    for name, t in rows:
        log(f"{name:<44}{t:>9.4f}{sol / t:>8.2f}{tb / t:>14.2f}x{bb / t:>12.2f}x")
    e = a["engine"][best]["seconds"]
    return {**a, "sol_s": sol, "best": best, "sol_ratio": sol / e, "vs_floor": e / floor,
            "speedup_vs_tensor_bcast": tb / e, "speedup_vs_bucket_bcast": bb / e,
            "exact": all(x["exact"] for x in a["engine"].values()),
            "baseline_exact": all(c["exact"] for r in a["baseline_checked"].values() for c in r.values())}


def report_b(b: dict, a: dict | None, log) -> dict:
    gbps = a["link"]["p2p_gbps"] if a else float("nan")
    plan = sum(r["plan_bytes"] for r in next(iter(b["sliced"].values()))["ready"].values() if "plan_bytes" in r)
    sol = plan / (gbps * 1e9)
    log(f"\nscenario B: 1 producer GPU0 -> TP2 replica, both consumers on GPU1, +fp8; plans {plan / 1e9:.2f} GB")
    out = {"sol_s": sol, "plan_bytes": plan, "raw": b}
    for t in b["sliced"]:
        s, f = b["sliced"][t]["seconds"], b["full_pull"][t]["seconds"]
        out[t] = {"sliced_s": s, "full_pull_s": f, "speedup": f / s, "sol_ratio": sol / s,
                  "exact": b["sliced"][t]["exact"] and b["full_pull"][t]["exact"]}
        log(f"  {t:<10} sliced {s:.4f} s (SoL/t {sol / s:.2f}), full pull {f:.4f} s: {f / s:.2f}x, "
            f"exact={out[t]['exact']}")
    return out


def report_c(c: dict, a: dict | None, log) -> dict:
    gbps = a["link"]["p2p_gbps"] if a else float("nan")
    plan = next(iter(c.values()))["ready"]["tp0"]["plan_bytes"]
    sol = plan / (gbps * 1e9)
    log("\nscenario C: 2 producers (PP2) on GPU0 -> 1 consumer TP1 on GPU1, +fp8")
    out = {"sol_s": sol, "raw": c}
    for t, r in c.items():
        out[t] = {"seconds": r["seconds"], "sol_ratio": sol / r["seconds"], "exact": r["exact"]}
        log(f"  {t:<10} {r['seconds']:.4f} s (SoL/t {sol / r['seconds']:.2f}) exact={r['exact']}")
    return out


def headline(s: dict) -> dict:
    out: dict = {}
    if "A" in s:
        a = s["A"]
        out.update(A_best=a["best"], A_sol_ratio=round(a["sol_ratio"], 3), A_vs_floor=round(a["vs_floor"], 3),
                   A_vs_tensor_bcast=round(a["speedup_vs_tensor_bcast"], 2),
                   A_vs_bucket_bcast=round(a["speedup_vs_bucket_bcast"], 2), A_exact=a["exact"],
                   A_baseline_exact=a["baseline_exact"],
                   A_seconds={t: round(r["seconds"], 4) for t, r in a["engine"].items()})
    for k in ("B", "C"):
        if k in s:
            out[k] = {t: {kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in r.items()}
                      for t, r in s[k].items() if isinstance(r, dict) and t not in ("raw",)}
    return out


if __name__ == "__main__":
    main()
