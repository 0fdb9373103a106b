"""The processes of ``gpu_sync.py``, one object each in a process of its own (``shardsync.testing.harness.hosts``):
a producer (``GpuProducer``: its PP share of Qwen3-30B-A3B-shaped weights on GPU0, deterministic per seed) or a
zoo consumer (``GpuConsumer``: vLLM's loader semantics on GPU1 through ``harness.consumers.ZooConsumer``, plus
the FP8 process step, the byte check, the link and floor measurements). Both also run the broadcast baselines
(``shardsync.programs.baseline``). ``--device cpu`` runs the same objects on CPU (tcp, nccl:gloo)."""

from __future__ import annotations

import json
import os
import statistics
import time
import zlib

import torch

from shardsync.engine.consumer.consumer import Consumer
from shardsync.engine.producer.producer import Producer, ProducerConfig
from shardsync.kernels.fp8 import quantize_fp8_blocks, scale_shape
from shardsync.plan import graphs
from shardsync.plan.groups import base_group, weight_group
from shardsync.plan.pack import _packed_view, layout_group
from shardsync.plan.validate import same_bytes
from shardsync.source import ModuleSource
from shardsync.programs import baseline
from shardsync.testing.harness.consumers import ZooConsumer, zoo_plan
from shardsync.testing.harness.trainers import pp_share
from shardsync.types import ParamMeta
from shardsync.testing.zoo import ZooConfig, hf_shapes

graphs.ENABLED = os.environ.get("SHARDSYNC_CUDA_GRAPHS", "1") != "0"  # the benchmark's switch (graphs off: "0")
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_30b_a3b.json")
FP8_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "w13_weight", "w2_weight")
TOKEN = "bench"
BUCKET = {"tensor": 0, "bucket": 1 << 30}
"""The broadcast baselines (``programs/baseline.py``): per-tensor, and 1 GiB buckets."""


def zoo_config(args) -> ZooConfig:
    c = json.load(open(CONFIG))
    cfg = ZooConfig(vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                    heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                    experts=c["num_experts"], moe_inter=c["moe_intermediate_size"], qk_norm=True)
    over = {k: v for k, v in (("layers", args.layers), ("experts", args.experts),
                              ("moe_inter", getattr(args, "moe_inter", 0))) if v}
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

    def __init__(self, params: dict[str, torch.Tensor], groups: list[str]):
        self.by_group: dict[str, list] = {}
        for n, p in params.items():
            if n.endswith(FP8_SUFFIXES):
                q = torch.empty(p.shape, dtype=torch.float8_e4m3fn, device=p.device)
                s = torch.empty(scale_shape(tuple(p.shape)), dtype=torch.float32, device=p.device)
                self.by_group.setdefault(weight_group(n), []).append((p, q, s, n))
        self.parts: dict[str, frozenset[str]] = {}
        """A layer -> the plan groups writing it (itself, or its parts: ``plan/split.py``)."""
        for g in groups:
            self.parts[base_group(g)] = self.parts.get(base_group(g), frozenset()) | {g}
        self.begin()

    def begin(self) -> None:
        """A new sync: each layer waits for all its parts again."""
        self.left = {b: set(ps) for b, ps in self.parts.items()}

    def run(self, g: str) -> None:
        """Group ``g`` applied: a layer is processed once every part of it is in (a whole layer at once)."""
        b = base_group(g)
        left = self.left.get(b, set())
        left.discard(g)
        if left and g != b:
            return
        for p, q, s, _ in self.by_group.get(b, []):
            quantize_fp8_blocks(p, q, s)


def _transport(name: str) -> tuple[str, dict]:
    """``cuda_ipc``, ``nccl:gloo`` (a backend); suffixes: ``+slots`` (the consumer reads through receive slots even
    where it could read the producer's ring directly), ``+checksums`` (xxh3 of every chunk, sent and verified),
    ``+delta`` (delta sync on producers and consumers: ``ProducerConfig.delta``, ``Consumer(delta=True)``), ``+packed``
    (no source reads: every group packed into the ring, ``ProducerConfig.source_reads=False``)."""
    t, _, backend = name.split("+")[0].partition(":")
    return t, ({"backend": backend} if backend else {})


# ------------------------------------------------------------------------------------------------ processes
def _device(args, gpu: int) -> torch.device:
    """Producers on GPU0, consumers on GPU1 — or, with one GPU, everyone on GPU0 (colocated)."""
    if args.device == "cuda":
        gpu = min(gpu, torch.cuda.device_count() - 1)
    dev = torch.device(f"cuda:{gpu}" if args.device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def _baseline_world(args, rank: int, dev: torch.device) -> list:
    return baseline.init_baseline(rank, 2, args.port, 1, backend="nccl" if dev.type == "cuda" else "gloo",
                                  timeout_s=600)


class GpuProducer:
    """Producer ``rank`` of ``n`` on GPU0 (a PP share when ``n > 1``); ``bcast_world``: it also sends the
    baselines (rank 0 of a two-rank world with the consumer)."""

    def __init__(self, rank: int, n: int, args, bcast_world: bool):
        self.dev, self.rank, self.n, self.args = _device(args, 0), rank, n, args
        self.metas = metadata(zoo_config(args))
        names = [m.name for m in self.metas]
        self.held = set(pp_share(names, rank, n)) if n > 1 else set(names)
        self.state = {m.name: torch.empty(m.shape, dtype=torch.bfloat16,
                                          device=self.dev if m.name in self.held else "meta") for m in self.metas}
        self.reseed(1)
        self.source = ModuleSource(self.state, held=self.held if n > 1 else None)
        if bcast_world:
            self.bgroups = _baseline_world(args, 0, self.dev)
            self.owner = baseline.owners([names], self.metas)
        self.prod = None

    def reseed(self, seed: int) -> None:
        for nm in self.held:
            fill(self.state[nm], nm, seed)

    def setup(self, tname: str, coord, n_cons: int):
        """A producer over ``tname`` (its init waits for the consumers: :meth:`init`); its address."""
        t, kw = _transport(tname)
        a = self.args
        pcfg = ProducerConfig(rank=self.rank, n_producers=self.n, n_consumers=n_cons, token=TOKEN, transport=t,
                              transport_kwargs=kw, coordinator=coord, device=str(self.dev) if self.dev.type == "cuda"
                              else None, max_chunk_bytes=a.chunk_mb << 20, lookahead=a.lookahead, timeout_s=300,
                              lease_s=30, verify_checksums=True if "+checksums" in tname else None,
                              delta="+delta" in tname, source_reads=False if "+packed" in tname else None)
        self.prod = Producer(self.source, pcfg)
        return self.prod.address

    def init(self) -> dict:
        self.prod.init()
        return dict(self.prod.stats)

    def sync(self, v: int) -> dict:
        c0 = time.process_time()
        r = profiled(self.args, f"producer{self.rank}", self.prod.sync, v)
        return {"cpu_s": time.process_time() - c0,  # host CPU seconds of this process (all its threads)
                **{k: r[k] for k in ("seconds", "bytes_sent", "max_resident", "slot_wait_s", "gather_s", "pack_s",
                                     "source_groups")},
                **{k: v for k, v in r.items() if k.startswith("delta_")}}

    def teardown(self) -> None:
        self.prod.close()
        self.prod = None

    def bcast(self, mode: str) -> dict:
        return {"seconds": baseline.broadcast_send(self.source, self.metas, self.owner, 0, self.bgroups,
                                                   bucket_bytes=BUCKET[mode], device=self.dev, barrier=True)}

    def close(self) -> None:
        if self.prod is not None:
            self.teardown()


class GpuConsumer:
    """Consumer ``cid`` (TP rank ``rank`` of ``tp``) on GPU1 with the FP8 step; ``full_pull``: its plan is every
    full tensor (a TP1 plan) and its loader keeps its share; ``bcast_world``: it also receives the baselines."""

    def __init__(self, cid: str, tp: int, rank: int, full_pull: bool, args, bcast_world: bool):
        self.dev, self.cid, self.args = _device(args, 1), cid, args
        self.metas = metadata(zoo_config(args))
        self.by_name = {m.name: m for m in self.metas}
        self.zoo = ZooConsumer(zoo_config(args), cid, tp=tp, tp_rank=rank, device=self.dev)
        self.full_pull = full_pull
        self.plan = zoo_plan(self.zoo.cfg, self.metas, cid) if full_pull else self.zoo.record(self.metas)
        self.proc = Processor({} if getattr(args, "no_process", False) else self.zoo.params,
                              [g.name for g in self.plan.groups])
        self.layouts = {g.name: layout_group(g) for g in self.plan.groups}
        if not full_pull:
            for g in self.plan.groups:
                self.zoo.unpacker(g.name)  # built before the first sync
        self.full_views: dict[tuple[str, int], list] = {}
        if bcast_world:
            self.bgroups = _baseline_world(args, 1, self.dev)
            self.owner = baseline.owners([[m.name for m in self.metas]], self.metas)
        self.cons = None

    def apply(self, g: str, buf: torch.Tensor) -> None:
        if self.full_pull:  # every full tensor arrived: the loader keeps this rank's share
            key = (g, buf.data_ptr())
            if key not in self.full_views:
                gp, lay = self.plan.group(g), self.layouts[g]
                self.full_views[key] = [(s.src, _packed_view(buf, lay.offsets[i], s))
                                        for i, s in enumerate(gp.scatters)]
                assert all(tuple(v.shape) == tuple(self.by_name[n].shape) for n, v in self.full_views[key])
            self.zoo.live.load_weights(self.full_views[key])
        else:
            self.zoo.apply(g, buf)
        self.proc.run(g)

    def setup(self, tname: str, coord) -> dict:
        """A consumer over ``tname``, initialised (plan registered, routes known); its stats."""
        t, kw = _transport(tname)
        direct = False if self.full_pull or tname.endswith("+slots") else None  # full pull: apply wants a buffer
        self.cons = Consumer(self.cid, coord, token=TOKEN, record=lambda _m: self.plan, apply=self.apply,
                             transport=t, transport_kwargs=kw, timeout_s=300, recv_slots=self.args.recv_slots,
                             direct_reads=direct, verify_checksums="+checksums" in tname, delta="+delta" in tname,
                             device=str(self.dev) if self.dev.type == "cuda" else None)
        self.cons.init()
        return dict(self.cons.stats, plan_bytes=self.plan.nbytes)

    def poison(self) -> None:
        with torch.no_grad():
            for p in self.zoo.params.values():
                p.view(torch.uint8).fill_(0xA5)
            for grp in self.proc.by_group.values():
                for _, q, s, _ in grp:
                    q.view(torch.uint8).fill_(0xA5)
                    s.fill_(float("nan"))

    def sync(self, v: int) -> dict:
        c0 = time.process_time()
        self.proc.begin()
        r = profiled(self.args, self.cid, self.cons.sync, v)
        return {"cpu_s": time.process_time() - c0,
                **{k: r[k] for k in ("seconds", "bytes_received", "apply_s", "recv_slots_used", "recv_bytes",
                                     "transports", "ready_wait_s", "read_s", "direct_from", "source_groups")},
                **{k: v for k, v in r.items() if k.startswith("delta_")}}

    def check(self, seed: int) -> dict:
        return check(self.zoo, self.metas, self.proc, seed)

    def teardown(self) -> None:
        self.cons.close()
        self.cons = None

    def bcast(self, mode: str) -> dict:
        """The baseline: full tensors broadcast, this rank's loader keeps its share, then the FP8 step per layer."""
        secs, _ = baseline.broadcast_receive(self.metas, self.owner, self.bgroups, self.zoo.live.load_weights,
                                             bucket_bytes=BUCKET[mode], device=self.dev, barrier=True,
                                             on_group=self.proc.run)
        return {"seconds": secs}

    def link(self) -> dict:
        return link(self.plan, self.layouts, self.dev)

    def close(self) -> None:
        if self.cons is not None:
            self.teardown()


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
