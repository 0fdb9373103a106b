"""GPU benchmark: Qwen3-30B-A3B-shaped weights, trainer on GPU0, consumers on GPU1 (two H200s).

One command, every number measured in the same run (median of ``--iters`` syncs after warm-up):

Scenario A — one consumer (TP1) on GPU1:
  * speed of light: plan bytes / raw GPU0->GPU1 copy bandwidth measured here (CUDA IPC peer copy);
  * shardsync over CUDA IPC and over NCCL p2p, pipelined and not (ablation), with and without the
    FP8 process step (128x128 block scales, one fused Triton kernel, in place into kernel tensors);
  * baselines: per-tensor NCCL broadcast + loader, and 1 GiB bucketed broadcast + loader;
  * stage times measured alone (replay+pack, transfer, scatter, process).
Scenario B — one TP2 replica whose two consumer processes share GPU1, over CUDA IPC: shardsync
(each pulls only its slices) vs each consumer pulling every full tensor and keeping its share.
Correctness: after the last sync the consumer compares, layer by layer, its checkpoint-format buffers
and its FP8 kernel tensors with what its loaders + the same process step give on the full tensors.

    python benchmarks/gpu_sync.py --out $OUT            # full model (needs two ~140 GB GPUs)
    python benchmarks/gpu_sync.py --layers 2 --experts 8 --device cpu   # logic check on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from shardsync.kernels.fp8 import quantize_fp8_blocks, scale_shape  # noqa: E402
from shardsync.plan.pack import _packed_view, dst_view, layout_group, replay  # noqa: E402
from shardsync.plan.record import record_plan  # noqa: E402
from shardsync.types import ParamMeta  # noqa: E402
from shardsync.plan.validate import same_bytes  # noqa: E402
from shardsync.zoo import ZooConfig, ZooModel, hf_shapes  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_30b_a3b.json")
FP8_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "w13_weight", "w2_weight")
SLOTS, RECV_SLOTS = 3, 2


def zoo_config(args) -> ZooConfig:
    c = json.load(open(CONFIG))
    cfg = ZooConfig(vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                    heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                    experts=c["num_experts"], moe_inter=c["moe_intermediate_size"], qk_norm=True)
    if args.layers:
        cfg = ZooConfig(**{**cfg.__dict__, "layers": args.layers})
    if args.experts:
        cfg = ZooConfig(**{**cfg.__dict__, "experts": args.experts})
    if args.device == "cpu":  # logic check: shrink
        cfg = ZooConfig(**{**cfg.__dict__, "vocab": 1024, "hidden": 256, "heads": 4, "kv_heads": 2,
                           "head_dim": 128, "moe_inter": 256})
    return cfg


def metadata(cfg: ZooConfig) -> list[ParamMeta]:
    return [ParamMeta(name=n, dtype="bfloat16", shape=s) for n, s in hf_shapes(cfg).items()]


def make_weights(metas: list[ParamMeta], device: str, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """All full tensors as views of one flat bf16 buffer (random, never zero)."""
    total = sum(m.numel for m in metas)
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    step = 1 << 28
    for i in range(0, total, step):
        n = min(step, total - i)
        flat[i:i + n].copy_(torch.randn(n, generator=g, device=device) * 0.5 + 0.01)
    return flat, dict(zip((m.name for m in metas), _views(flat, metas)))


def _views(flat: torch.Tensor, metas) -> list[torch.Tensor]:
    out, off = [], 0
    for m in metas:
        out.append(flat[off: off + m.numel].view(m.shape))
        off += m.numel
    return out


def record(cfg: ZooConfig, metas, tp: int, rank: int):
    with torch.device("meta"):
        dry = ZooModel(cfg, tp_size=tp, tp_rank=rank)
    return record_plan(metadata=metas, load_weights=dry.load_weights, params=dict(dry.named_parameters()),
                       consumer=f"tp{rank}", rank=rank)


class Side:
    """Prepared copy lists of one plan: producer pack (per slot) and consumer unpack (per recv slot)."""

    def __init__(self, plan):
        self.plan = plan
        self.groups = [g.name for g in plan.groups]
        self.layouts = {g.name: layout_group(g) for g in plan.groups}
        self.max_group = max(lay.nbytes for lay in self.layouts.values())

    def prepare_pack(self, weights, slots, base: dict[str, int] | None = None):
        self.pack_src, self.pack_dst = {}, {}
        for g in self.plan.groups:
            lay, b = self.layouts[g.name], (base or {}).get(g.name, 0)
            self.pack_src[g.name] = [replay(s, weights[s.src]) for s in g.scatters]
            self.pack_dst[g.name] = [[_packed_view(slot, b + lay.offsets[i], s) for i, s in enumerate(g.scatters)]
                                     for slot in slots]

    def pack(self, g: str, slot: int) -> None:
        torch._foreach_copy_(self.pack_dst[g][slot], self.pack_src[g])

    def prepare_unpack(self, params, recv):
        self.un_dst, self.un_src = {}, {}
        for g in self.plan.groups:
            lay = self.layouts[g.name]
            self.un_dst[g.name] = [dst_view(params[s.dst], s) for s in g.scatters]
            self.un_src[g.name] = [[_packed_view(r, lay.offsets[i], s) for i, s in enumerate(g.scatters)]
                                   for r in recv]
            for f in g.fills:
                dst_view(params[f.dst], f).fill_(f.value)

    def unpack(self, g: str, r: int) -> None:
        torch._foreach_copy_(self.un_dst[g], self.un_src[g][r])


class Processor:
    """The FP8 process step: per layer, quantise its linear / expert weights into kernel tensors."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.by_group: dict[str, list] = {}
        for n, p in params.items():
            if n.endswith(FP8_SUFFIXES):
                q = torch.empty(p.shape, dtype=torch.float8_e4m3fn, device=p.device)
                s = torch.empty(scale_shape(tuple(p.shape)), dtype=torch.float32, device=p.device)
                self.by_group.setdefault(n.rsplit(".", 3)[0] if ".layers." in n else "pre", []).append((p, q, s, n))

    def group_of(self, g: str) -> list:
        return self.by_group.get(g, [])

    def run(self, g: str) -> None:
        for p, q, s, _ in self.group_of(g):
            quantize_fp8_blocks(p, q, s)


def make_ring(nbytes: int, dev) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """SLOTS equal slots carved from one allocation (one NIXL registration covers them all)."""
    nbytes = -(-nbytes // 256) * 256
    ring = torch.empty(SLOTS * nbytes, dtype=torch.uint8, device=dev)
    return ring, [ring[i * nbytes:(i + 1) * nbytes] for i in range(SLOTS)]


def nixl_producer(ring: torch.Tensor, args) -> dict | None:
    if not args.nixl:
        return None
    from shardsync.transport.nixl import NixlTransport

    t = NixlTransport(name="producer")
    nixl_producer.keep = t  # the agent must outlive this call
    return {"desc": t.register(ring), "slot_bytes": ring.numel() // SLOTS}


def nixl_consumer(info: dict | None, recv: list[torch.Tensor], name: str):
    if not info:
        return None
    from shardsync.transport.nixl import NixlTransport

    t = NixlTransport(name=name)
    t.connect(0, info["desc"])
    for r in recv:  # register the receive slots once (the first read of each does it)
        t.read(0, 0, min(r.numel(), info["slot_bytes"]), r, timeout_s=60)
    return t


def barrier(dev) -> None:
    dist.barrier(device_ids=[dev.index]) if dev.type == "cuda" else dist.barrier()


def sync_dev(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------- A
def trainer_setup(args):
    """The trainer on GPU0: device, config, metadata and the full random weights."""
    dev = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cfg = zoo_config(args)
    metas = metadata(cfg)
    return (dev, cfg, metas, *make_weights(metas, str(dev), seed=1))


def scenario_a_producer(args, q_in, q_out, flags, q_ring):
    dev, cfg, metas, flat, weights = trainer_setup(args)
    plan = record(cfg, metas, 1, 0)
    side = Side(plan)
    ring, slots = make_ring(side.max_group, dev)
    if dev.type == "cpu":
        flat.share_memory_()
        for sl in slots:
            sl.share_memory_()
        weights = {n: v for n, v in zip(weights, _views(flat, metas))}
    side.prepare_pack(weights, slots)
    q_ring.put({"slots": slots, "flat": flat, "nixl": nixl_producer(ring, args)})  # straight to the consumer
    q_out.put({"max_group": side.max_group})
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=0, world_size=2, timeout=timedelta(seconds=600))
    while (cmd := q_in.get()) is not None:
        mode, pipelined, _version = cmd["mode"], cmd["pipelined"], cmd["version"]
        barrier(dev)
        t0 = time.perf_counter()
        if mode in ("ipc", "nixl"):
            for i, g in enumerate(side.groups):
                s = i % SLOTS
                if i >= SLOTS:
                    while flags[1] < i - SLOTS + 1:  # consumer released group i-SLOTS (its slot)
                        pass
                side.pack(g, s)
                sync_dev(dev)
                flags[0] = i + 1  # ready
        elif mode == "nccl":
            works: dict[int, object] = {}  # a work is waited exactly once (gloo hangs on a second wait)
            for i, g in enumerate(side.groups):
                s = i % SLOTS
                if i - SLOTS in works:
                    works.pop(i - SLOTS).wait()  # slot s free again: its previous send finished
                side.pack(g, s)
                works[i] = dist.isend(slots[s][: side.layouts[g].nbytes], dst=1)
                if not pipelined:
                    works.pop(i).wait()
                    sync_dev(dev)
                    dist.recv(torch.zeros(1, device=dev), src=1)  # consumer done with this group
            for w in works.values():
                w.wait()
        elif mode == "bcast_tensor":
            for m in metas:
                dist.broadcast(weights[m.name], src=0)
        elif mode == "bcast_bucket":
            bucket = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
            for chunk in buckets(metas, 1 << 30):
                off = 0
                for m in chunk:
                    bucket[off: off + m.nbytes].view(torch.bfloat16).view(m.shape).copy_(weights[m.name])
                    off += m.nbytes
                dist.broadcast(bucket[:off], src=0)
        elif mode == "stage_pack":
            for i, g in enumerate(side.groups):
                side.pack(g, i % SLOTS)
        sync_dev(dev)
        q_out.put({"producer_s": time.perf_counter() - t0})
        barrier(dev)


def buckets(metas, cap):
    cur, size = [], 0
    for m in metas:
        if cur and size + m.nbytes > cap:
            yield cur
            cur, size = [], 0
        cur.append(m)
        size += m.nbytes
    if cur:
        yield cur


def scenario_a_consumer(args, q_in, q_out, flags, q_ring):
    dev = torch.device("cuda:1" if args.device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ring = q_ring.get(timeout=1800)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=1, world_size=2, timeout=timedelta(seconds=600))
    cfg = zoo_config(args)
    metas = metadata(cfg)
    plan = record(cfg, metas, 1, 0)
    side = Side(plan)
    with torch.device(dev):
        live = ZooModel(cfg, tp_size=1, tp_rank=0)
    params = dict(live.named_parameters())
    recv = [torch.empty(side.max_group, dtype=torch.uint8, device=dev) for _ in range(RECV_SLOTS)]
    side.prepare_unpack(params, recv)
    proc = Processor(params)
    slots, flat = ring["slots"], ring["flat"]
    nx = nixl_consumer(ring.get("nixl"), recv, "consumer")
    copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    results = {"plan_bytes": plan.nbytes, "groups": len(side.groups), "tensors": len(metas)}
    layer_left: dict[str, int] = {}
    for m in metas:
        from shardsync.plan.groups import weight_group
        layer_left[weight_group(m.name)] = layer_left.get(weight_group(m.name), 0) + 1
    while (cmd := q_in.get()) is not None:
        mode, pipelined, process = cmd["mode"], cmd["pipelined"], cmd["process"]
        barrier(dev)
        t0 = time.perf_counter()
        if mode in ("ipc", "nixl"):
            done_ev = [None] * RECV_SLOTS
            for i, g in enumerate(side.groups):
                r = i % RECV_SLOTS
                n = side.layouts[g].nbytes
                while flags[0] < i + 1:
                    pass
                if mode == "nixl":  # one-sided READ of the producer's slot (UCX cuda_ipc within a node)
                    if done_ev[r] is not None:
                        done_ev[r].synchronize()
                    nx.read(0, (i % SLOTS) * ring["nixl"]["slot_bytes"], n, recv[r], timeout_s=60)
                elif copy_stream is not None:
                    with torch.cuda.stream(copy_stream):
                        if done_ev[r] is not None:
                            copy_stream.wait_event(done_ev[r])
                        recv[r][:n].copy_(slots[i % SLOTS][:n], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(copy_stream)
                    ev.synchronize()
                    torch.cuda.current_stream(dev).wait_event(ev)
                else:
                    recv[r][:n].copy_(slots[i % SLOTS][:n])
                flags[1] = i + 1  # release the producer's slot: bytes are here
                side.unpack(g, r)
                if process:
                    proc.run(g)
                if dev.type == "cuda":
                    done_ev[r] = torch.cuda.Event()
                    done_ev[r].record()
                if not pipelined:
                    sync_dev(dev)
        elif mode == "nccl":
            works = {}
            ahead = RECV_SLOTS if pipelined else 1
            for i, g in enumerate(side.groups[:ahead]):
                works[i] = dist.irecv(recv[i % RECV_SLOTS][: side.layouts[g].nbytes], src=0)
            for i, g in enumerate(side.groups):
                works.pop(i).wait()
                side.unpack(g, i % RECV_SLOTS)
                if process:
                    proc.run(g)
                if not pipelined:
                    sync_dev(dev)
                    dist.send(torch.zeros(1, device=dev), dst=0)
                j = i + ahead
                if j < len(side.groups):
                    works[j] = dist.irecv(recv[j % RECV_SLOTS][: side.layouts[side.groups[j]].nbytes], src=0)
        elif mode in ("bcast_tensor", "bcast_bucket"):
            left = dict(layer_left)
            from shardsync.plan.groups import weight_group
            it = ([[m] for m in metas] if mode == "bcast_tensor" else buckets(metas, 1 << 30))
            bucket = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
            for chunk in it:
                if mode == "bcast_tensor":
                    m = chunk[0]
                    t = torch.empty(m.shape, dtype=torch.bfloat16, device=dev)
                    dist.broadcast(t, src=0)
                    tensors = [(m.name, t)]
                else:
                    nb = sum(m.nbytes for m in chunk)
                    dist.broadcast(bucket[:nb], src=0)
                    tensors, off = [], 0
                    for m in chunk:
                        tensors.append((m.name, bucket[off: off + m.nbytes].view(torch.bfloat16).view(m.shape)))
                        off += m.nbytes
                live.load_weights(tensors)  # the consumer keeps its share with its ordinary loader
                for name, _ in tensors:
                    g = weight_group(name)
                    left[g] -= 1
                    if left[g] == 0 and process:
                        proc.run(g)
        elif mode == "stage_unpack":
            for i, g in enumerate(side.groups):
                side.unpack(g, i % RECV_SLOTS)
        elif mode == "stage_process":
            for g in side.groups:
                proc.run(g)
        elif mode == "stage_copy":  # raw transfer of the plan's bytes, group by group, over CUDA IPC
            for i, g in enumerate(side.groups):
                n = side.layouts[g].nbytes
                recv[i % RECV_SLOTS][:n].copy_(slots[i % SLOTS][:n], non_blocking=True)
        elif mode == "sol":  # raw GPU0->GPU1 copy bandwidth, one big buffer
            n = min(flat.numel() * 2, 4 << 30)
            src = flat.view(torch.uint8)[:n]
            dst = torch.empty(n, dtype=torch.uint8, device=dev)
            dst.copy_(src)
            sync_dev(dev)
            ts = time.perf_counter()
            for _ in range(3):
                dst.copy_(src, non_blocking=True)
            sync_dev(dev)
            results["p2p_gbps"] = 3 * n / (time.perf_counter() - ts) / 1e9
            del dst
        sync_dev(dev)
        q_out.put({"consumer_s": time.perf_counter() - t0, **results})
        barrier(dev)
        if cmd.get("check"):
            q_out.put(check_a(cfg, metas, flat, live, params, proc, dev))


def check_a(cfg, metas, flat, live, params, proc, dev) -> dict:
    """Layer by layer: loaders + process step on the full tensors == what the sync left behind."""
    views = dict(zip((m.name for m in metas), _views(flat, metas)))
    one = ZooConfig(**{**cfg.__dict__, "layers": 1})
    with torch.device(dev):
        ref = ZooModel(one, tp_size=1, tp_rank=0)
    bad, compared = [], 0
    ref_params = dict(ref.named_parameters())
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        ref.load_weights([(n.replace(p, "model.layers.0."), v) for n, v in views.items() if n.startswith(p)])
        for n, t in ref_params.items():
            if not n.startswith("model.layers.0."):
                continue
            ln = n.replace("model.layers.0.", p)
            compared += 1
            if not same_bytes(t, params[ln]):
                bad.append(ln)
            if n.endswith(FP8_SUFFIXES):
                for lp, q, s, name in proc.group_of(p[:-1]):
                    if name == ln:
                        rq, rs = torch.empty_like(q), torch.empty_like(s)
                        quantize_fp8_blocks(t, rq, rs)
                        compared += 1
                        if not (same_bytes(rq, q) and torch.equal(rs, s)):
                            bad.append(ln + " (fp8)")
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        r = torch.empty_like(params[n])
        r.copy_(views[n])
        compared += 1
        if not same_bytes(r, params[n]):
            bad.append(n)
    return {"check_compared": compared, "check_mismatched": bad[:20]}


procs: list = []


def get(q, timeout_s: float):
    """Queue get that notices a dead child instead of waiting out the timeout."""
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=5)
        except queue.Empty:
            dead = [p.name for p in procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"benchmark child died or timed out: dead={dead}")


def run_a(args, log) -> dict:
    ctx = mp.get_context("spawn")
    flags = torch.zeros(2, dtype=torch.int64).share_memory_()
    qp_in, qp_out, qc_in, qc_out, q_ring = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    prod = ctx.Process(target=scenario_a_producer, args=(args, qp_in, qp_out, flags, q_ring), daemon=True)
    prod.start()
    cons = ctx.Process(target=scenario_a_consumer, args=(args, qc_in, qc_out, flags, q_ring), daemon=True)
    cons.start()
    procs.extend([prod, cons])
    get(qp_out, 900)
    out: dict = {}

    def once(mode, pipelined=True, process=True, check=False):
        flags.zero_()
        qp_in.put({"mode": mode, "pipelined": pipelined, "version": 0})
        qc_in.put({"mode": mode, "pipelined": pipelined, "process": process, "check": check})
        p, c = get(qp_out, 600), get(qc_out, 600)
        return max(p["producer_s"], c["consumer_s"]), c

    def med(mode, **kw):
        if time.perf_counter() - t_start > args.budget_s:
            log(f"  A {mode} {kw}: skipped (time budget)")
            return float("nan")
        once(mode, **kw)  # warm-up
        ts = [once(mode, **kw)[0] for _ in range(args.iters)]
        log(f"  A {mode:<13} {kw}: median {statistics.median(ts):.4f} s  (all {[round(t, 4) for t in ts]})")
        return statistics.median(ts)

    t_start = time.perf_counter()
    _, info = once("sol")
    out.update(plan_bytes=info["plan_bytes"], tensors=info["tensors"], groups=info["groups"],
               p2p_gbps=info["p2p_gbps"])
    out["sol_s"] = info["plan_bytes"] / (info["p2p_gbps"] * 1e9)
    log(f"A: {info['tensors']} tensors, {info['plan_bytes'] / 1e9:.2f} GB, p2p {info['p2p_gbps']:.1f} GB/s, "
        f"SoL {out['sol_s']:.4f} s")
    out["ipc_s"] = med("ipc")
    _, chk = once("ipc", check=True)
    out.update(get(qc_out, 600))
    log(f"  correctness: {out['check_compared']} tensors compared, mismatched {out['check_mismatched']}")
    out["nccl_s"] = med("nccl")
    if args.nixl:
        out["nixl_s"] = med("nixl")
    out["bcast_bucket_s"] = med("bcast_bucket")
    out["bcast_tensor_s"] = med("bcast_tensor")
    out["ipc_noproc_s"] = med("ipc", process=False)
    out["nccl_noproc_s"] = med("nccl", process=False)
    out["bcast_bucket_noproc_s"] = med("bcast_bucket", process=False)
    out["ipc_unpipelined_s"] = med("ipc", pipelined=False)
    out["nccl_unpipelined_s"] = med("nccl", pipelined=False)
    for st in ("stage_pack", "stage_copy", "stage_unpack", "stage_process"):
        out[st + "_s"] = med(st)
    qp_in.put(None), qc_in.put(None)
    prod.join(60), cons.join(60)
    procs.clear()
    return out


# ----------------------------------------------------------------------------------------------- B
def scenario_b_producer(args, q_in, q_out, flags, q_rings):
    """Trainer on GPU0 serving one TP2 replica whose two consumers share GPU1, over CUDA IPC."""
    dev, cfg, metas, flat, weights = trainer_setup(args)
    sides = [Side(record(cfg, metas, 2, r)) for r in range(2)]
    full = Side(record(cfg, metas, 1, 0))  # the baseline packs whole tensors once, for both consumers
    base1 = {g: -(-sides[0].layouts[g].nbytes // 256) * 256 for g in sides[0].groups}
    slot_bytes = max(max(base1[g] + sides[1].layouts[g].nbytes for g in sides[0].groups), full.max_group)
    ring, slots = make_ring(slot_bytes, dev)
    if dev.type == "cpu":
        flat.share_memory_()
        for sl in slots:
            sl.share_memory_()
        weights = dict(zip((m.name for m in metas), _views(flat, metas)))
    sides[0].prepare_pack(weights, slots)
    sides[1].prepare_pack(weights, slots, base=base1)
    full.prepare_pack(weights, slots)
    nx = nixl_producer(ring, args)
    for q in q_rings:
        q.put({"slots": slots, "base1": base1, "nixl": nx})
    q_out.put({"ok": 1})
    while (cmd := q_in.get()) is not None:
        t0 = time.perf_counter()
        groups = sides[0].groups
        for i, g in enumerate(groups):
            if i >= SLOTS:
                while min(int(flags[1]), int(flags[2])) < i - SLOTS + 1:  # both consumers released the slot
                    pass
            if cmd["mode"].startswith("full"):
                full.pack(g, i % SLOTS)
            else:
                sides[0].pack(g, i % SLOTS)
                sides[1].pack(g, i % SLOTS)
            sync_dev(dev)
            flags[0] = i + 1
        q_out.put({"producer_s": time.perf_counter() - t0})


def scenario_b_consumer(args, rank, q_in, q_out, flags, q_ring):
    dev = torch.device("cuda:1" if args.device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ring = q_ring.get(timeout=1800)
    slots, base1 = ring["slots"], ring["base1"]
    cfg = zoo_config(args)
    metas = metadata(cfg)
    side, full = Side(record(cfg, metas, 2, rank)), Side(record(cfg, metas, 1, 0))
    with torch.device(dev):
        live = ZooModel(cfg, tp_size=2, tp_rank=rank)
    params = dict(live.named_parameters())
    size = max(side.max_group, full.max_group)
    recv = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(RECV_SLOTS)]
    side.prepare_unpack(params, recv)
    proc = Processor(params)
    full_views = {g.name: [[(s.src, _packed_view(r, full.layouts[g.name].offsets[i], s)) for i, s in
                            enumerate(g.scatters)] for r in recv] for g in full.plan.groups}
    copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    nx = nixl_consumer(ring.get("nixl"), recv, f"consumer{rank}")
    q_out.put({"plan_bytes": side.plan.nbytes, "full_bytes": full.plan.nbytes})
    while (cmd := q_in.get()) is not None:
        t0 = time.perf_counter()
        is_full = cmd["mode"].startswith("full")
        via_nixl = cmd["mode"].endswith("nixl")
        done_ev = [None] * RECV_SLOTS
        for i, g in enumerate(side.groups):
            r = i % RECV_SLOTS
            off = 0 if (is_full or rank == 0) else base1[g]
            n = (full if is_full else side).layouts[g].nbytes
            while int(flags[0]) < i + 1:
                pass
            src = slots[i % SLOTS][off: off + n]
            if via_nixl:
                if done_ev[r] is not None:
                    done_ev[r].synchronize()
                nx.read(0, (i % SLOTS) * ring["nixl"]["slot_bytes"] + off, n, recv[r], timeout_s=60)
            elif copy_stream is not None:
                with torch.cuda.stream(copy_stream):
                    if done_ev[r] is not None:
                        copy_stream.wait_event(done_ev[r])
                    recv[r][:n].copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(copy_stream)
                ev.synchronize()
                torch.cuda.current_stream(dev).wait_event(ev)
            else:
                recv[r][:n].copy_(src)
            flags[1 + rank] = i + 1
            if is_full:  # a broadcast delivers everything: the loader keeps this rank's share
                live.load_weights(full_views[g][r])
            else:
                side.unpack(g, r)
            proc.run(g)
            if dev.type == "cuda":
                done_ev[r] = torch.cuda.Event()
                done_ev[r].record()
        sync_dev(dev)
        q_out.put({"consumer_s": time.perf_counter() - t0})


def run_b(args, log) -> dict:
    ctx = mp.get_context("spawn")
    flags = torch.zeros(3, dtype=torch.int64).share_memory_()
    qp_in, qp_out = ctx.Queue(), ctx.Queue()
    qc = [(ctx.Queue(), ctx.Queue(), ctx.Queue()) for _ in range(2)]
    prod = ctx.Process(target=scenario_b_producer, args=(args, qp_in, qp_out, flags, [q[2] for q in qc]), daemon=True)
    prod.start()
    cons = [ctx.Process(target=scenario_b_consumer, args=(args, r, qc[r][0], qc[r][1], flags, qc[r][2]), daemon=True)
            for r in range(2)]
    for c in cons:
        c.start()
    procs.extend([prod, *cons])
    get(qp_out, 900)
    info = [get(q[1], 900) for q in qc]
    out = {"plan_bytes_per_consumer": [i["plan_bytes"] for i in info], "full_bytes": info[0]["full_bytes"]}

    def once(mode):
        flags.zero_()
        qp_in.put({"mode": mode})
        for q in qc:
            q[0].put({"mode": mode})
        return max([get(qp_out, 600)["producer_s"]] + [get(q[1], 600)["consumer_s"] for q in qc])

    for mode in ("shardsync", "full") + (("shardsync_nixl", "full_nixl") if args.nixl else ()):
        once(mode)
        ts = [once(mode) for _ in range(args.iters)]
        out[mode + "_s"] = statistics.median(ts)
        log(f"  B {mode:<10}: median {out[mode + '_s']:.4f} s  (all {[round(t, 4) for t in ts]})")
    qp_in.put(None)
    for q in qc:
        q[0].put(None)
    for p in (prod, *cons):
        p.join(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--port", type=int, default=29513)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--scenarios", default="AB")
    ap.add_argument("--nixl", action="store_true", help="also NIXL READ (needs nixl + nixl-cu13 installed)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip remaining modes after this many seconds")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "gpu_sync.log"), "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    log(f"gpu_sync {time.strftime('%Y-%m-%d %H:%M:%S')} device={args.device} "
        f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}")
    try:
        a = run_a(args, log) if "A" in args.scenarios else None
        b = run_b(args, log) if "B" in args.scenarios else None
    finally:  # never leave children holding the GPUs (or the command) hanging
        for p in procs:
            if p.is_alive():
                p.kill()
    summary: dict = {}
    if a is not None:
        summary.update(report_a(a, log))
    if b is not None:
        p2p = a["p2p_gbps"] if a else float("nan")
        b["sol_s"] = sum(b["plan_bytes_per_consumer"]) / (p2p * 1e9)
        b["speedup_vs_full_pull"] = b["full_s"] / b["shardsync_s"]
        log(f"\n{'scenario B (TP2 on GPU1, CUDA IPC, +fp8)':<46}{'seconds':>9}{'SoL/t':>8}{'vs full pull':>14}")
        log(f"{'SoL (both consumers bytes / p2p copy)':<46}{b['sol_s']:>9.4f}{1:>8.2f}")
        log(f"{'shardsync (each pulls only its slices)':<46}{b['shardsync_s']:>9.4f}{b['sol_s'] / b['shardsync_s']:>8.2f}"
            f"{b['speedup_vs_full_pull']:>13.2f}x")
        log(f"{'baseline: each pulls every full tensor':<46}{b['full_s']:>9.4f}{b['sol_s'] / b['full_s']:>8.2f}{1:>13.2f}x")
        if "shardsync_nixl_s" in b:
            b["speedup_vs_full_pull_nixl"] = b["full_nixl_s"] / b["shardsync_nixl_s"]
            log(f"{'shardsync over NIXL READ':<46}{b['shardsync_nixl_s']:>9.4f}{b['sol_s'] / b['shardsync_nixl_s']:>8.2f}"
                f"{b['speedup_vs_full_pull_nixl']:>13.2f}x")
            log(f"{'baseline over NIXL READ (full pull)':<46}{b['full_nixl_s']:>9.4f}{b['sol_s'] / b['full_nixl_s']:>8.2f}"
                f"{1:>13.2f}x")
        summary["scenario_b"] = b
        summary["speedup_vs_full_pull_b"] = b["speedup_vs_full_pull"]
    json.dump(summary, open(os.path.join(args.out, "gpu_sync.json"), "w"), indent=1)
    log(json.dumps({k: v for k, v in summary.items() if not k.startswith("scenario_")}))


def report_a(a: dict, log) -> dict:
    sol = a["sol_s"]
    rows = [("SoL (plan bytes / p2p copy)", sol), ("shardsync IPC, pipelined, +fp8", a["ipc_s"]),
            ("shardsync IPC, pipelined, no process", a["ipc_noproc_s"]),
            ("shardsync IPC, not pipelined, +fp8", a["ipc_unpipelined_s"]),
            ("shardsync NCCL p2p, pipelined, +fp8", a["nccl_s"]),
            ("shardsync NCCL p2p, pipelined, no process", a["nccl_noproc_s"]),
            ("shardsync NCCL p2p, not pipelined, +fp8", a["nccl_unpipelined_s"]),
            *([("shardsync NIXL READ, pipelined, +fp8", a["nixl_s"])] if "nixl_s" in a else []),
            ("baseline bucketed 1 GiB bcast, +fp8", a["bcast_bucket_s"]),
            ("baseline bucketed 1 GiB bcast, no process", a["bcast_bucket_noproc_s"]),
            ("baseline per-tensor bcast, +fp8", a["bcast_tensor_s"])]
    best = min(a["ipc_s"], a["nccl_s"])
    log("\nstage times alone (s): " + ", ".join(f"{k[6:-2]} {a[k]:.4f}" for k in a if k.startswith("stage_")))
    log(f"{'scenario A':<46}{'seconds':>9}{'SoL/t':>8}{'vs per-tensor':>15}{'vs bucketed':>13}")
    for name, t in rows:
        log(f"{name:<46}{t:>9.4f}{sol / t:>8.2f}{a['bcast_tensor_s'] / t:>14.2f}x{a['bcast_bucket_s'] / t:>12.2f}x")
    summary = {"scenario_a": a, "best_s": best, "sol_ratio": sol / best,
               "speedup_vs_tensor_bcast": a["bcast_tensor_s"] / best,
               "speedup_vs_bucket_bcast": a["bcast_bucket_s"] / best,
               "exact": not a["check_mismatched"] and a["check_compared"] > 0}
    return summary


if __name__ == "__main__":
    main()
