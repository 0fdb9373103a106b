"""GPU benchmark of the engine a user runs: ``Producer`` on GPU0, ``Consumer``s on GPU1, through the coordinator
and the control plane, for Qwen3-30B-A3B-shaped weights (two H200s).

Every number comes from one run (median of ``--iters`` syncs after two warm-up syncs — the first builds the
packers' and unpackers' views; it is reported as ``first_sync_s``):

* A — one producer (the whole model) -> one TP1 consumer whose ``apply`` is vLLM's loader semantics (zoo) plus
  the FP8 process step (128x128 block scales, one fused Triton kernel, in place): the engine over each transport
  (``cuda_ipc``, ``nccl``, ``nixl`` if installed); beside it, in the same processes, the speed of light (plan
  bytes / a raw GPU0->GPU1 copy), the floor (the plan's groups copied back to back with no control plane, no
  pack and no apply: what a pipeline could reach at best at this granularity) and the baselines
  (``shardsync.tools.baseline``, the one ``shardsync bench`` times: per-tensor and 1 GiB bucketed NCCL broadcast,
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
import traceback
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from shardsync.engine.consumer import Consumer  # noqa: E402
from shardsync.engine.producer import Producer, ProducerConfig  # noqa: E402
from shardsync.kernels.fp8 import quantize_fp8_blocks, scale_shape  # noqa: E402
from shardsync.plan.groups import weight_group  # noqa: E402
from shardsync.plan.pack import _packed_view, layout_group  # noqa: E402
from shardsync.plan.validate import same_bytes  # noqa: E402
from shardsync.source import ModuleSource  # noqa: E402
from shardsync.tools import baseline  # noqa: E402
from shardsync.tools.cluster_procs import pp_share  # noqa: E402
from shardsync.tools.harness.consumers import ZooConsumer, zoo_plan  # noqa: E402
from shardsync.types import ParamMeta  # noqa: E402
from shardsync.zoo import ZooConfig, hf_shapes  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_30b_a3b.json")
FP8_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "w13_weight", "w2_weight")
TOKEN = "bench"
BUCKET = {"tensor": 0, "bucket": 1 << 30}
"""The broadcast baselines (``tools/baseline.py``): per-tensor, and 1 GiB buckets."""


def zoo_config(args) -> ZooConfig:
    c = json.load(open(CONFIG))
    cfg = ZooConfig(vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                    heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                    experts=c["num_experts"], moe_inter=c["moe_intermediate_size"], qk_norm=True)
    over = {k: v for k, v in (("layers", args.layers), ("experts", args.experts)) if v}
    if args.device == "cpu":  # logic check: shrink
        over.update(vocab=1024, hidden=256, heads=4, kv_heads=2, head_dim=128, moe_inter=256)
    return ZooConfig(**{**cfg.__dict__, **over})


def metadata(cfg: ZooConfig) -> list[ParamMeta]:
    return [ParamMeta(name=n, dtype="bfloat16", shape=s) for n, s in hf_shapes(cfg).items()]


def fill(t: torch.Tensor, name: str, seed: int) -> torch.Tensor:
    """Deterministic random (never zero) values for one tensor at one seed, on any device: the trainer and the
    checker regenerate the same bytes independently."""
    g = torch.Generator(device=t.device).manual_seed(zlib.crc32(name.encode()) * 1000 + seed)
    return t.copy_(torch.randn(t.shape, generator=g, device=t.device) * 0.5 + 0.01)


class Processor:
    """The FP8 process step: per layer, quantise its linear / expert weights into kernel tensors, in place."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.by_group: dict[str, list] = {}
        for n, p in params.items():
            if n.endswith(FP8_SUFFIXES):
                q = torch.empty(p.shape, dtype=torch.float8_e4m3fn, device=p.device)
                s = torch.empty(scale_shape(tuple(p.shape)), dtype=torch.float32, device=p.device)
                self.by_group.setdefault(weight_group(n), []).append((p, q, s, n))

    def run(self, g: str) -> None:
        for p, q, s, _ in self.by_group.get(g, []):
            quantize_fp8_blocks(p, q, s)


def _transport(name: str) -> tuple[str, dict]:
    t, _, backend = name.partition(":")
    return t, ({"backend": backend} if backend else {})


# ------------------------------------------------------------------------------------------------ processes
def producer_proc(rank: int, n: int, args, q_in, q_out, bcast_world: bool) -> None:
    try:
        dev = torch.device("cuda:0" if args.device == "cuda" else "cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        cfg = zoo_config(args)
        metas = metadata(cfg)
        names = [m.name for m in metas]
        held = set(pp_share(names, rank, n)) if n > 1 else set(names)
        state = {m.name: torch.empty(m.shape, dtype=torch.bfloat16, device=dev if m.name in held else "meta")
                 for m in metas}

        def reseed(seed: int) -> None:
            for nm in held:
                fill(state[nm], nm, seed)

        reseed(1)
        source = ModuleSource(state, held=held if n > 1 else None)
        if bcast_world:
            bgroups = baseline.init_baseline(0, 2, args.port, 1, backend="nccl" if dev.type == "cuda" else "gloo",
                                             timeout_s=600)
            owner = baseline.owners([names], metas)
        q_out.put(("started", rank))
        prod = None
        while (cmd := q_in.get()) is not None:
            kind = cmd[0]
            if kind == "setup":
                _, tname, coord, n_cons = cmd
                t, kw = _transport(tname)
                pcfg = ProducerConfig(rank=rank, n_producers=n, n_consumers=n_cons, token=TOKEN, transport=t,
                                      transport_kwargs=kw, coordinator=coord, device=str(dev) if dev.type == "cuda"
                                      else None, max_chunk_bytes=args.chunk_mb << 20, lookahead=args.lookahead,
                                      timeout_s=300, lease_s=30)
                prod = Producer(source, pcfg)
                q_out.put(("address", rank, prod.address))
                prod.init()
                q_out.put(("ready", rank, dict(prod.stats)))
            elif kind == "reseed":
                reseed(cmd[1])
                q_out.put(("reseeded", rank))
            elif kind == "sync":
                r = profiled(args, f"producer{rank}", prod.sync, cmd[1])
                q_out.put(("synced", rank, {k: r[k] for k in ("seconds", "bytes_sent", "max_resident", "slot_wait_s",
                                                              "gather_s", "pack_s")}))
            elif kind == "close":
                prod.close()
                prod = None
                q_out.put(("closed", rank))
            elif kind == "bcast":
                secs = baseline.broadcast_send(source, metas, owner, 0, bgroups, bucket_bytes=BUCKET[cmd[1]],
                                               device=dev, barrier=True)
                q_out.put(("bcast", rank, {"seconds": secs}))
    except BaseException as e:
        q_out.put(("error", rank, f"producer {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))


def profiled(args, who: str, fn, *a):
    """``--profile``: cProfile of the calling thread (the producer's gather/pack loop, the consumer's sync)."""
    if not getattr(args, "profile", False):
        return fn(*a)
    import cProfile
    import pstats

    pr = cProfile.Profile()
    r = pr.runcall(fn, *a)
    with open(os.path.join(args.out, f"profile-{who}.txt"), "a") as f:
        f.write(f"\n==== {who} sync {a} {r.get('seconds', 0):.4f} s\n")
        pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(18)
    return r


def consumer_proc(cid: str, tp: int, rank: int, full_pull: bool, args, q_in, q_out, bcast_world: bool) -> None:
    try:
        dev = torch.device("cuda:1" if args.device == "cuda" else "cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        cfg = zoo_config(args)
        metas = metadata(cfg)
        by_name = {m.name: m for m in metas}
        zoo = ZooConsumer(cfg, cid, tp=tp, tp_rank=rank, device=dev)
        live, params = zoo.live, zoo.params
        plan = zoo_plan(cfg, metas, cid) if full_pull else zoo.record(metas)  # full pull: a TP1 plan, every tensor
        proc = Processor(params)
        layouts = {g.name: layout_group(g) for g in plan.groups}
        if not full_pull:
            for g in plan.groups:
                zoo.unpacker(g.name)  # built before the first sync
        full_views: dict[tuple[str, int], list] = {}

        def apply(g: str, buf: torch.Tensor) -> None:
            if full_pull:  # every full tensor arrived: the loader keeps this rank's share
                key = (g, buf.data_ptr())
                if key not in full_views:
                    gp, lay = plan.group(g), layouts[g]
                    full_views[key] = [(s.src, _packed_view(buf, lay.offsets[i], s)) for i, s in enumerate(gp.scatters)]
                    assert all(tuple(v.shape) == tuple(by_name[n].shape) for n, v in full_views[key])
                live.load_weights(full_views[key])
            else:
                zoo.apply(g, buf)
            proc.run(g)

        if bcast_world:
            bgroups = baseline.init_baseline(1, 2, args.port, 1, backend="nccl" if dev.type == "cuda" else "gloo",
                                             timeout_s=600)
            owner = baseline.owners([[m.name for m in metas]], metas)
        q_out.put(("started", cid))
        cons = None
        while (cmd := q_in.get()) is not None:
            kind = cmd[0]
            if kind == "setup":
                _, tname, coord = cmd
                t, kw = _transport(tname)
                cons = Consumer(cid, coord, token=TOKEN, record=lambda _m: plan, apply=apply, transport=t,
                                transport_kwargs=kw, timeout_s=300, recv_slots=args.recv_slots,
                                device=str(dev) if dev.type == "cuda" else None)
                cons.init()
                q_out.put(("ready", cid, dict(cons.stats, plan_bytes=plan.nbytes)))
            elif kind == "poison":
                with torch.no_grad():
                    for p in params.values():
                        p.view(torch.uint8).fill_(0xA5)
                    for grp in proc.by_group.values():
                        for _, q, s, _ in grp:
                            q.view(torch.uint8).fill_(0xA5)
                            s.fill_(float("nan"))
                q_out.put(("poisoned", cid))
            elif kind == "sync":
                r = profiled(args, cid, cons.sync, cmd[1])
                q_out.put(("synced", cid, {k: r[k] for k in ("seconds", "bytes_received", "apply_s", "recv_slots_used",
                                                             "recv_bytes", "transports", "ready_wait_s",
                                                             "read_s")}))
            elif kind == "check":
                q_out.put(("checked", cid, check(zoo, metas, proc, cmd[1])))
            elif kind == "close":
                cons.close()
                cons = None
                q_out.put(("closed", cid))
            elif kind == "bcast":  # the baseline: full tensors, this rank's loader keeps its share, then fp8
                secs, _ = baseline.broadcast_receive(metas, owner, bgroups, live.load_weights,
                                                     bucket_bytes=BUCKET[cmd[1]], device=dev, barrier=True,
                                                     on_group=proc.run)
                q_out.put(("bcast", cid, {"seconds": secs}))
            elif kind == "link":
                q_out.put(("link", cid, link(plan, layouts, dev)))
    except BaseException as e:
        q_out.put(("error", cid, f"consumer {cid}: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))


def link(plan, layouts, dev) -> dict:
    """The link's speed of light (a 4 GiB GPU0->GPU1 copy) and the floor: the plan's groups copied back to back,
    group-sized, with no control plane, pack or apply."""
    if dev.type != "cuda":
        return {"p2p_gbps": float("nan"), "floor_s": float("nan")}
    n = 4 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    dst.copy_(src)
    torch.cuda.synchronize(0), torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(0), torch.cuda.synchronize(dev)
    gbps = 3 * n / (time.perf_counter() - t0) / 1e9
    sizes = [layouts[g.name].nbytes for g in plan.groups]
    floors = []
    for _ in range(3):
        torch.cuda.synchronize(0), torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for s in sizes:
            dst[:s].copy_(src[:s], non_blocking=True)
        torch.cuda.synchronize(0), torch.cuda.synchronize(dev)
        floors.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return {"p2p_gbps": gbps, "floor_s": statistics.median(floors)}


def check(zoo: ZooConsumer, metas, proc, seed: int) -> dict:
    """Layer by layer: this rank's loaders + the process step on the full tensors at ``seed`` == what the syncs
    left behind, byte for byte (bf16 buffers and FP8 kernel tensors)."""
    cfg, params, dev = zoo.cfg, zoo.params, zoo.device
    ref = zoo.model(dev, ZooConfig(**{**cfg.__dict__, "layers": 1}))
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    bad, compared = [], 0

    def full(keep) -> list:  # one layer (or the few non-layer tensors) at a time: GPU memory
        return [(m.name, fill(torch.empty(m.shape, dtype=torch.bfloat16, device=dev), m.name, seed))
                for m in metas if keep(m.name)]

    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        ref.load_weights([(n.replace(p, "model.layers.0."), t) for n, t in full(lambda n, p=p: n.startswith(p))])
        for n, t in ref_params.items():
            if not n.startswith("model.layers.0."):
                continue
            ln = n.replace("model.layers.0.", p)
            compared += 1
            if not same_bytes(t, params[ln]):
                bad.append(ln)
            for lp, q, s, name in proc.by_group.get(p[:-1], []):
                if name == ln:
                    rq, rs = torch.empty_like(q), torch.empty_like(s)
                    quantize_fp8_blocks(t, rq, rs)
                    compared += 1
                    if not (same_bytes(rq, q) and same_bytes(rs, s)):
                        bad.append(ln + " (fp8)")
    ref.load_weights(full(lambda n: not n.startswith("model.layers.")))
    for n in ref_params:
        if not n.startswith("model.layers."):
            compared += 1
            if not same_bytes(ref_params[n], params[n]):
                bad.append(n)
    return {"compared": compared, "mismatched": bad[:20], "exact": compared > 0 and not bad}


# ------------------------------------------------------------------------------------------------ driver
class Group:
    """The processes of one scenario and a command/reply protocol with them (a dead child is noticed)."""

    def __init__(self, args, producers: int, consumers: list[tuple[str, int, int, bool]], bcast: bool):
        ctx = mp.get_context("spawn")
        self.q_out = ctx.Queue()
        self.qs: dict = {}
        self.procs: list = []
        for r in range(producers):
            self.qs[r] = ctx.Queue()
            self.procs.append(ctx.Process(target=producer_proc, args=(r, producers, args, self.qs[r], self.q_out,
                                                                      bcast and r == 0), daemon=True))
        for cid, tp, rank, full_pull in consumers:
            self.qs[cid] = ctx.Queue()
            self.procs.append(ctx.Process(target=consumer_proc, args=(cid, tp, rank, full_pull, args, self.qs[cid],
                                                                      self.q_out, bcast), daemon=True))
        for p in self.procs:
            p.start()
        self.producers = list(range(producers))
        self.consumers = [c[0] for c in consumers]
        self.expect("started", set(self.qs), 1800)

    def expect(self, kind: str, who: set, timeout_s: float = 900) -> dict:
        import queue

        got: dict = {}
        deadline = time.monotonic() + timeout_s
        while set(got) != set(who):
            try:
                msg = self.q_out.get(timeout=5)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"waiting for {kind!r} from {sorted(map(str, set(who) - set(got)))}: "
                                       f"dead={dead}") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(msg[2])
            if msg[0] != kind:
                raise RuntimeError(f"expected {kind!r}, got {msg[:2]}")
            got[msg[1]] = msg[2] if len(msg) > 2 else None
        return got

    def send(self, who, *cmd) -> None:
        for w in who:
            self.qs[w].put(cmd)

    def setup(self, transport: str) -> dict:
        self.send([0], "setup", transport, None, len(self.consumers))
        coord = self.expect("address", {0})[0]
        self.send(self.producers[1:], "setup", transport, coord, len(self.consumers))
        self.send(self.consumers, "setup", transport, coord)
        self.expect("address", set(self.producers[1:]))
        return self.expect("ready", set(self.producers) | set(self.consumers), 1800)

    def sync(self, v: int) -> tuple[float, dict]:
        self.send(self.producers + self.consumers, "sync", v)
        r = self.expect("synced", set(self.producers) | set(self.consumers))
        return max(x["seconds"] for x in r.values()), r

    def run_engine(self, transport: str, iters: int, v0: int) -> dict:
        """Two warm-up syncs (the first builds the views) + ``iters`` timed syncs; then new weights, poisoned
        consumers, one more sync, byte check."""
        ready = self.setup(transport)
        self.send(self.producers, "reseed", 1)
        self.expect("reseeded", set(self.producers))
        cold, _ = self.sync(v0)  # builds the packers' and unpackers' views (kept from the second sync on)
        self.sync(v0 + 1)
        times, last = [], {}
        for i in range(iters):
            t, last = self.sync(v0 + 2 + i)
            times.append(t)
        self.send(self.producers, "reseed", 2)
        self.expect("reseeded", set(self.producers))
        self.send(self.consumers, "poison")
        self.expect("poisoned", set(self.consumers))
        self.sync(v0 + 2 + iters)
        self.send(self.consumers, "check", 2)
        checked = self.expect("checked", set(self.consumers), 1800)
        self.send(self.producers + self.consumers, "close")
        self.expect("closed", set(self.producers) | set(self.consumers))
        return {"seconds": statistics.median(times), "all_s": [round(t, 4) for t in times], "first_sync_s": cold,
                "exact": all(c["exact"] for c in checked.values()), "checked": checked,
                "ready": {str(k): v for k, v in ready.items()}, "last": {str(k): v for k, v in last.items()}}

    def bcast(self, mode: str, iters: int, seed: int = 3) -> tuple[float, dict]:
        """The broadcast baseline: a warm-up + ``iters`` timed rounds; before the last one the trainer's weights
        change (``seed``) and the consumers are poisoned; afterwards the same byte check as the engine's."""
        ts = []
        for i in range(iters + 1):
            if i == iters:
                self.send(self.producers, "reseed", seed)
                self.expect("reseeded", set(self.producers))
                self.send(self.consumers, "poison")
                self.expect("poisoned", set(self.consumers))
            self.send([0] + self.consumers, "bcast", mode)
            r = self.expect("bcast", {0} | set(self.consumers), 1800)
            ts.append(max(x["seconds"] for x in r.values()))
        self.send(self.consumers, "check", seed)
        return statistics.median(ts[1:]), self.expect("checked", set(self.consumers), 1800)

    def close(self) -> None:
        for q in self.qs.values():
            q.put(None)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--port", type=int, default=29513)
    ap.add_argument("--chunk-mb", type=int, default=1024, help="ProducerConfig.max_chunk_bytes in MiB")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--recv-slots", type=int, default=4)
    ap.add_argument("--transports", default="", help="comma list (default: cuda_ipc,nccl[,nixl] on GPUs; "
                                                     "tcp,nccl:gloo on CPU)")
    ap.add_argument("--scenarios", default="ABC")
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
    groups: list[Group] = []
    try:
        if "A" in args.scenarios:
            g = Group(args, 1, [("tp0", 1, 0, False)], bcast=True)
            groups.append(g)
            a: dict = {}
            g.send(["tp0"], "link")
            a["link"] = g.expect("link", {"tp0"})["tp0"]
            a["engine"] = {}
            for i, t in enumerate(transports):
                a["engine"][t] = g.run_engine(t, args.iters, 1 + 100 * i)
                log(f"  A engine {t:<10}: median {a['engine'][t]['seconds']:.4f} s {a['engine'][t]['all_s']} "
                    f"exact={a['engine'][t]['exact']}; last sync: {stages(a['engine'][t]['last'])}")
            a["baseline_checked"] = {}
            for mode, what in (("bucket", "bucketed 1 GiB"), ("tensor", "per-tensor")):
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
            for p in g.procs:
                if p.is_alive():
                    p.kill()
    json.dump(summary, open(os.path.join(args.out, "gpu_sync.json"), "w"), indent=1, default=str)
    log(json.dumps(headline(summary), default=str))


def stages(last: dict) -> str:
    """Where a sync's host time went, per process (producer: waiting for a ring slot, gathering, packing;
    consumer: waiting for Ready, reading, applying)."""
    keys = ("slot_wait_s", "gather_s", "pack_s", "ready_wait_s", "read_s", "apply_s")
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
            ("baseline: bucketed 1 GiB bcast + load", a["bcast_bucket_s"]),
            ("baseline: per-tensor bcast + load", a["bcast_tensor_s"])]
    for name, t in rows:
        log(f"{name:<44}{t:>9.4f}{sol / t:>8.2f}{a['bcast_tensor_s'] / t:>14.2f}x{a['bcast_bucket_s'] / t:>12.2f}x")
    e = a["engine"][best]["seconds"]
    return {**a, "sol_s": sol, "best": best, "sol_ratio": sol / e, "vs_floor": e / floor,
            "speedup_vs_tensor_bcast": a["bcast_tensor_s"] / e, "speedup_vs_bucket_bcast": a["bcast_bucket_s"] / e,
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
