"""``shardsync simulate``: plan, route and cost one weight sync at cluster scale, without a cluster.

The planning stages run for real: every distinct inference rank's model is built on the meta device
with vLLM loader semantics and recorded by :func:`shardsync.record.record_plan`; the plans are routed
by :func:`shardsync.route.route_plans` and laid out by :func:`shardsync.pack.layout_group` (through
``chunk_layouts``), exactly as the coordinator does. Only the clock is modelled::

    run_simulate(config=None, preset="kimi-k2-48n", trainer=None, inference=None, replicas=None,
                 trainer_nodes=None, as_json=True)

Modelling choices:

- **Producers.** Every trainer rank is a producer. Megatron order: TP fastest, then DP, then PP;
  inside a PP stage the experts are laid out ETP fastest, then EP, then expert-DP. PP stages own
  contiguous, balanced blocks of layers (``pre`` on the first stage, ``post`` on the last). A
  non-expert tensor is held, full, by *every* rank of its stage: each TP group all-gathers it
  (the gather is costed on NVLink) and every DP copy has it; the router picks one holder per
  (plan, group) and balances bytes. A routed expert is held by the ranks of its EP rank (its
  ETP group, gathered; and its expert-DP copies). Nothing is ever gathered across PP or EP.
- **Placement.** Producer ``r`` sits on trainer node ``r // gpus_per_node``; consumers (replica-major)
  fill the inference nodes that follow, or the trainer nodes with ``colocate=True``. Each GPU has
  one NIC of ``nic_gbps`` **Gbit/s** and NVLink of ``nvlink_gbps`` **GB/s** per direction; a flow
  between GPUs of one node uses NVLink, any other flow the two GPUs' NICs.
- **Times.** *Absolute SoL*: the slowest of (bytes into one replica ÷ its GPUs' NICs) and (all bytes
  ÷ all trainer NICs). *Serial-PP SoL*: PP stages served one after another, each bounded by its own
  ranks' NICs (every replica pulls each byte from the stage) and by each replica's NICs; summed.
  *Serial-PP schedule* (``predicted_s``; the consumer's ``parallel_producers=False`` reference, and what
  the engine did before PP stages were pulled in parallel): consumers pull groups in transfer order, producers keep ``lookahead + 1`` groups, so a group moves roughly in lockstep:
  its time is the busiest link's bytes ÷ bandwidth (a producer's NIC shared by the consumers it
  serves, each consumer's NIC its own limit) plus control round trips (2 per producer, ``CONTROL_RTT_S``)
  and one ``READ_LATENCY_S`` per chunk; gather (TP all-gather on NVLink) + pack (``HBM_COPY_BPS``) of
  group g+1 overlap group g's transfer, unpack/apply of g-1 too; pipeline fill and drain are added.
  *Parallel PP* (``parallel_pp_s``; the engine's default schedule: one puller per producer, receive slots
  shared under the head rule of ``engine/consumer/recvslots.py``): consumers pull from ``k`` PP stages at once, ``k``
  bounded by a receive-memory budget (k + 1 slots of the largest group); time = max(consumer NICs, stage work ÷ k, slowest
  stage, a stage's gather + pack in turn, a consumer's apply in turn) + fill + drain.
- **Delta sync** (``--changed-fraction``; :mod:`shardsync.programs.sim_delta`): the same routes and clock again per
  fraction, each chunk in the codec's chosen form, encode after pack and decode before apply at stated rates.

Plans are recorded in ``full`` mode by default (every tensor through every distinct consumer's loaders; Kimi-K2's
32 distinct ranks take ~30 s on 2 cores); ``record="template"`` (:mod:`shardsync.plan.template`) gives the same
plans, digest for digest, in seconds. The table also reports the per-group route balance: ``route.py`` balances
whole-sync byte totals, so under the group-lockstep schedule one producer can carry several plans' share of the
same layer while its peers idle. The models and the cluster's rank arithmetic: :mod:`shardsync.programs.sim_models`.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Any, Sequence

from ..verify.output import emit_json
from ..plan.groups import POST, PRE, group_order, weight_group
from ..plan.route import chunk_layouts, route_plans
from .sim_delta import DECODE_GBPS, ENCODE_GBPS, DeltaModel, delta_summary, parse_fractions, scale_seed
from .sim_models import ModelSpec, Topology, expert_of, load_config, model_spec, record_plans
from .sim_report import table

__all__ = ["PRESETS", "Topology", "run_simulate", "simulate", "calibrate_cpu", "pipeline_time", "holders"]

CONTROL_RTT_S = 100e-6
"""One control round trip (``WaitReady`` / ``Released``) between nodes, Python control server included."""
READ_LATENCY_S = 10e-6
"""Issue-to-completion overhead of one one-sided chunk read (RDMA)."""
HBM_COPY_BPS = 2.1e12
"""Same-GPU copy rate measured on one H200 (docs/gpu.md): packing and unpacking slices."""
CPU_COPY_BPS = 5e9
CPU_RTT_S = 0.5e-3
"""The CPU bench's pack/unpack copy rate and control round trip (2 shared cores, TCP loopback)."""
DEFAULT_RECV_BUDGET = 8 << 30
"""Receive memory per consumer granted to the parallel-PP schedule (bytes)."""
LOOKAHEAD, RECV_SLOTS = 1, 2

PRESETS: dict[str, dict[str, Any]] = {
    "kimi-k2-48n": dict(config="kimi-k2", trainer="tp8,pp8,ep32,etp1", inference="tp32,ep32", replicas=4,
                        trainer_nodes=32, seed={"measured_s": 7.53, "abs_sol_s": 1.25, "serial_pp_sol_s": 5.0,
                                                "model_bytes": 2e12}, delta=(0.01, 0.02, 0.05)),
    "qwen3-235b-4n": dict(config="qwen3-235b-a22b", trainer="tp4,pp2,ep8", inference="dp16,ep16", replicas=1,
                          trainer_nodes=2, seed={"measured_s": 3.49}),
}


def stage_of_groups(groups: list[str], pp: int) -> dict[str, int]:
    """PP stage of each weight group: balanced contiguous layer blocks, ``pre`` first, ``post`` last."""
    layers = [g for g in group_order(groups) if g not in (PRE, POST)]
    out = {PRE: 0, POST: pp - 1}
    start = 0
    for s in range(pp):
        n = len(layers) // pp + (1 if s < len(layers) % pp else 0)
        out.update({g: s for g in layers[start:start + n]})
        start += n
    return out


def holders(spec: ModelSpec, names: list[str], top: Topology) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """name -> trainer ranks holding it full (see the module docstring), and group -> PP stage."""
    stage = stage_of_groups(sorted({weight_group(n) for n in names}), top.pp)
    ss = top.stage_size
    all_of = [tuple(range(s * ss, (s + 1) * ss)) for s in range(top.pp)]
    per_ep = max(spec.experts // top.ep, 1)
    edp = ss // (top.ep * top.etp)
    by_ep = {(s, e): tuple(sorted(s * ss + t + top.etp * (e + top.ep * d) for t in range(top.etp) for d in range(edp)))
             for s in range(top.pp) for e in range(top.ep)}
    out = {}
    for n in names:
        s, e = stage[weight_group(n)], expert_of(n)
        out[n] = all_of[s] if e is None else by_ep[(s, e // per_ep)]
    return out, stage


def pipeline_time(xfer: list[float], prep: list[float], apply: list[float]) -> tuple[float, list[float]]:
    """The implemented schedule's clock, groups in transfer order: fill (gather + pack of the first group),
    then per group max(its transfer, gather + pack of the next, apply of the previous), then drain
    (apply of the last). Returns (seconds, the per-group steps)."""
    n = len(xfer)
    steps = [max(x, prep[i + 1] if i + 1 < n else 0.0, apply[i - 1] if i else 0.0) for i, x in enumerate(xfer)]
    return prep[0] + sum(steps) + apply[-1], steps


def _top(cands: list[tuple[float, str]]) -> tuple[float, str]:
    """The largest (seconds, name); the first listed wins a tie."""
    return max(cands, key=lambda c: c[0])


def _sig(x: float) -> float:
    return float(f"{x:.5g}")


def simulate(spec: ModelSpec, top: Topology, *, nic_gbps: float = 400, nvlink_gbps: float = 450,
             record: str = "full", recv_budget: int = DEFAULT_RECV_BUDGET,
             delta: Sequence[DeltaModel] = ()) -> dict[str, Any]:
    """Record, route and cost one sync; returns every figure (bytes, buffers, times, bottlenecks). Each of
    ``delta`` costs the same sync again with that changed fraction (``r["delta"]``; :mod:`.sim_delta`)."""
    t0 = time.perf_counter()
    metas = spec.metadata()
    keys = [top.consumer_key(c) for c in range(top.consumers)]
    plans = record_plans(spec, keys, mode=record, metas=metas)
    t1 = time.perf_counter()
    by_digest = {p.digest: p for p in plans.values()}
    consumers_of: dict[str, list[int]] = defaultdict(list)
    for c, k in enumerate(keys):
        consumers_of[plans[k].digest].append(c)
    hold, stage = holders(spec, [m.name for m in metas], top)
    routes, load = route_plans(by_digest, hold, {d: len(cs) for d, cs in consumers_of.items()})
    lays = {d: chunk_layouts(plan, hold) for d, plan in by_digest.items()}
    routed = dict(metas=metas, by_digest=by_digest, consumers_of=consumers_of, stage=stage, routes=routes, load=load,
                  lays=lays, record=record, record_s=round(t1 - t0, 2), route_s=round(time.perf_counter() - t1, 2))
    r = _cost(spec, top, routed, nic_gbps=nic_gbps, nvlink_gbps=nvlink_gbps, recv_budget=recv_budget)
    if delta:
        r["delta"] = [delta_summary(r, _cost(spec, top, routed, nic_gbps=nic_gbps, nvlink_gbps=nvlink_gbps,
                                             recv_budget=recv_budget, delta=d), d) for d in delta]
    return r


def _cost(spec: ModelSpec, top: Topology, routed: dict[str, Any], *, nic_gbps: float, nvlink_gbps: float,
          recv_budget: int, delta: DeltaModel | None = None) -> dict[str, Any]:
    """The clock of one sync over routed plans; with ``delta``, chunks travel in the codec's form at its changed
    fraction, producers encode after packing and consumers decode before unpacking (at its rates)."""
    nic, nvl = nic_gbps * 1e9 / 8, nvlink_gbps * 1e9
    metas, stage, load = routed["metas"], routed["stage"], routed["load"]
    size = {m.name: m.nbytes for m in metas}
    # flows: group -> producer -> consumer -> bytes, plus the producers' packing / gathering per group
    recv = defaultdict(lambda: defaultdict(lambda: [0, 0]))   # g -> c -> [inter, intra] (wire bytes)
    send = defaultdict(lambda: defaultdict(lambda: [0, 0]))   # g -> p -> [inter, intra]
    ctrl = defaultdict(lambda: defaultdict(float))            # g -> c -> control + read latency seconds
    packed = defaultdict(lambda: defaultdict(int))            # g -> p -> bytes packed (once per plan)
    unpacked = defaultdict(lambda: defaultdict(int))          # g -> c -> dense bytes applied
    gathered = defaultdict(lambda: defaultdict(set))          # g -> p -> full tensors gathered
    largest = (0, "")
    for d, plan in routed["by_digest"].items():
        for g in plan.groups:
            lay = routed["lays"][d][g.name]
            largest = max(largest, (lay.nbytes, g.name))
            per_p: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
            for c, p in zip(lay.chunks, routed["routes"][d][g.name]):
                per_p[p][0] += c.nbytes if delta is None else delta.wire_bytes(c.nbytes)
                per_p[p][1] += 1
                per_p[p][2] += c.nbytes
                gathered[g.name][p].update(s.src for s in g.scatters[c.first:c.stop])
            for p, (nb, nc, dense) in per_p.items():
                packed[g.name][p] += dense
                for c in routed["consumers_of"][d]:
                    intra = top.producer_node(p) == top.consumer_node(c)
                    recv[g.name][c][intra] += nb
                    send[g.name][p][intra] += nb
                    unpacked[g.name][c] += dense
                    ctrl[g.name][c] += 2 * CONTROL_RTT_S + nc * READ_LATENCY_S
    order = group_order(recv)
    enc_s = (lambda b: 0.0) if delta is None else delta.encode_s  # noqa: E731
    dec_s = (lambda b: 0.0) if delta is None else delta.decode_s  # noqa: E731

    def cname(c: int) -> str:
        return f"consumer {top.consumer_label(c)} (node {top.consumer_node(c)})"

    def pname(p: int) -> str:
        return f"producer {p} (node {top.producer_node(p)}, PP stage {p // top.stage_size})"

    def busiest(loads: dict, name) -> tuple[float, str]:
        best = (0.0, "")
        for x, (inter, intra) in loads.items():
            best = _top([best, (inter / nic, f"{name(x)} NIC"), (intra / nvl, f"{name(x)} NVLink")])
        return best

    def gather_s(g: str, p: int) -> float:
        shards = lambda n: top.etp if expert_of(n) is not None else top.tp  # noqa: E731
        link = nvl if top.tp <= top.gpn else nic
        return sum(size[n] * (shards(n) - 1) / shards(n) for n in gathered[g][p]) / link

    xfer, prep, apply_, blame = {}, {}, {}, defaultdict(float)
    for g in order:
        xfer[g] = _top([busiest(send[g], pname), busiest(recv[g], cname)])
        xfer[g] = (xfer[g][0] + max(ctrl[g].values()), xfer[g][1])
        prep[g] = max(gather_s(g, p) + packed[g][p] / HBM_COPY_BPS + enc_s(packed[g][p]) for p in packed[g])
        apply_[g] = max(v / HBM_COPY_BPS + dec_s(v) for v in unpacked[g].values())
    predicted, steps = pipeline_time([xfer[g][0] for g in order], [prep[g] for g in order],
                                     [apply_[g] for g in order])
    kinds: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for g, step in zip(order, steps):
        name = xfer[g][1] if step == xfer[g][0] else "gather/pack/apply"
        blame[name] += step
        kind = kinds[f"{name.split()[0]} {name.split()[-1]}s" if step == xfer[g][0] else name]
        kind[0], kind[1] = kind[0] + step, kind[1] + 1
    top_kind = max(kinds, key=lambda k: kinds[k][0])
    predicted_blame = (f"{top_kind} ({kinds[top_kind][1]} of {len(order)} groups; most: "
                       f"{max(blame, key=blame.get)})")

    # totals and splits
    c_tot = defaultdict(lambda: [0, 0])
    p_tot = defaultdict(lambda: [0, 0])
    for g in order:
        for c, v in recv[g].items():
            c_tot[c][0] += v[0]
            c_tot[c][1] += v[1]
        for p, v in send[g].items():
            p_tot[p][0] += v[0]
            p_tot[p][1] += v[1]
    rep_tot = defaultdict(lambda: [0, 0])
    for c, v in c_tot.items():
        rep_tot[c // top.per_replica][0] += v[0]
        rep_tot[c // top.per_replica][1] += v[1]
    total = [sum(v[0] for v in c_tot.values()), sum(v[1] for v in c_tot.values())]
    r_max = max(rep_tot, key=lambda r: sum(rep_tot[r]))
    def bound(v: list[int], n: int, what: str) -> tuple[float, str]:
        return _top([(v[0] / (n * nic), f"{what} NICs ({n} x {nic / 1e9:.0f} GB/s)"),
                     (v[1] / (n * nvl), f"{what} NVLink ({n} x {nvl / 1e9:.0f} GB/s)")])

    abs_sol = _top([bound(rep_tot[r], top.per_replica, f"replica {r}") for r in sorted(rep_tot)] +
                   [bound(total, top.producers, f"all {top.producers} trainer")])

    # serial PP: stage after stage, each limited by its own ranks' NICs and by each replica's NICs
    serial, serial_blame, stage_impl = 0.0, defaultdict(float), defaultdict(float)
    stage_prep: dict[int, float] = defaultdict(float)  # a stage's ranks gather + pack (+ encode) its groups in turn
    for s in range(top.pp):
        gs = [g for g in order if stage[g] == s]
        st = [sum(send[g][p][i] for g in gs for p in send[g]) for i in (0, 1)]
        rs = defaultdict(lambda: [0, 0])
        for g in gs:
            for c, v in recv[g].items():
                rs[c // top.per_replica][0] += v[0]
                rs[c // top.per_replica][1] += v[1]
        t = _top([bound(st, top.stage_size, "each PP stage's")] +
                 [(bound(v, top.per_replica, "replica")[0], "replica links") for v in rs.values()])
        serial += t[0]
        serial_blame[t[1]] += t[0]
        stage_impl[s] = sum(xfer[g][0] for g in gs)
        stage_prep[s] = sum(prep[g] for g in gs)

    # parallel PP under a receive budget: k streams, one per stage, each with its own slot (+1 applying)
    k = max(1, min(top.pp, recv_budget // max(largest[0], 1) - 1))
    worst_c = max(c_tot, key=lambda c: max(c_tot[c][0] / nic, c_tot[c][1] / nvl))
    ctrl_sum = sum(max(ctrl[g].values()) for g in order)
    worst = bound(c_tot[worst_c], 1, cname(worst_c))
    par = _top([(worst[0] + ctrl_sum / k, worst[1]),
              (sum(stage_impl.values()) / k, f"PP-stage concurrency ({k} of {top.pp} stages at once)"),
              (max(stage_impl.values()), f"PP stage {max(stage_impl, key=stage_impl.get)}"),
              (max(stage_prep.values()), f"PP stage {max(stage_prep, key=stage_prep.get)} gather/pack/encode"),
              (sum(apply_.values()), "consumer apply/decode")])
    par_s = par[0] + prep[order[0]] + apply_[order[-1]]

    imbalance = max((max(sum(v) for v in send[g].values()) * top.stage_size / sum(sum(v) for v in send[g].values()), g)
                    for g in order)
    peak_gather = max((sum(size[n] for n in ns), g) for g in order for ns in gathered[g].values())
    peak_pack = max((v for g in order for v in packed[g].values()), default=0)
    worst_p = max(p_tot, key=lambda p: sum(p_tot[p]))
    return {
        "model": spec.name, "arch": spec.arch, "model_bytes": sum(size.values()), "tensors": len(metas),
        "producers": top.producers, "producers_used": len(p_tot), "consumers": top.consumers,
        "distinct_plans": len(routed["by_digest"]), "record_mode": routed["record"], "record_s": routed["record_s"],
        "route_s": routed["route_s"], "nic_gbps": nic_gbps, "nvlink_gbps": nvlink_gbps,
        "replica_bytes": sum(rep_tot[r_max]), "total_bytes": sum(total), "inter_node_bytes": total[0],
        "intra_node_bytes": total[1],
        "per_consumer_bytes_max": max(sum(v) for v in c_tot.values()),
        "per_consumer_bytes_min": min(sum(v) for v in c_tot.values()),
        "per_consumer_inter_bytes_max": max(v[0] for v in c_tot.values()),
        "per_consumer_intra_bytes_max": max(v[1] for v in c_tot.values()),
        "per_producer_bytes_max": sum(p_tot[worst_p]), "per_producer_bytes_max_rank": worst_p,
        "per_producer_inter_bytes_max": max(v[0] for v in p_tot.values()),
        "per_producer_intra_bytes_max": max(v[1] for v in p_tot.values()),
        "producer_bytes_sum": sum(sum(v) for v in p_tot.values()),
        "consumer_bytes_sum": sum(sum(v) for v in c_tot.values()),
        "largest_group_bytes": largest[0], "largest_group": largest[1],
        "peak_recv_bytes": RECV_SLOTS * largest[0], "peak_gather_bytes": (LOOKAHEAD + 1) * peak_gather[0],
        "largest_gather_group": peak_gather[1],
        "group_imbalance": round(imbalance[0], 3), "group_imbalance_group": imbalance[1], "routed_bytes_sum": sum(load.values()),
        "peak_ring_bytes": (LOOKAHEAD + 1) * peak_pack,
        "per_producer_packed_bytes_max": max(sum(packed[g].get(p, 0) for g in order) for p in p_tot),
        "abs_sol_s": _sig(abs_sol[0]), "abs_sol_bottleneck": abs_sol[1],
        "serial_pp_sol_s": _sig(serial), "serial_pp_bottleneck": max(serial_blame, key=serial_blame.get),
        "predicted_s": _sig(predicted), "predicted_bottleneck": predicted_blame,
        "parallel_pp_s": _sig(par_s), "parallel_pp_bottleneck": par[1], "parallel_pp_streams": k,
        "parallel_pp_recv_bytes": (k + 1) * largest[0], "recv_budget_bytes": recv_budget,
    }


def run_simulate(*, config: str | None = None, preset: str | None = None, trainer: str | None = None,
                 inference: str | None = None, replicas: int | None = None, trainer_nodes: int | None = None,
                 gpus_per_node: int = 8, nic_gbps: float = 400, nvlink_gbps: float = 450, as_json: bool = False,
                 record: str = "full", colocate: bool = False, recv_budget: int = DEFAULT_RECV_BUDGET,
                 changed_fractions: Sequence[float] | None = None, encode_gbps: float = ENCODE_GBPS,
                 decode_gbps: float = DECODE_GBPS) -> dict:
    """CLI entry: a preset fills every argument left None (``changed_fractions`` too: ``[]`` for none); prints the
    table (and JSON as the last line)."""
    p = PRESETS.get(preset or "", {}) if preset else {}
    if preset and not p:
        raise ValueError(f"unknown preset {preset!r} (known: {sorted(PRESETS)})")
    config = config or p.get("config")
    trainer, inference = trainer or p.get("trainer"), inference or p.get("inference")
    replicas, trainer_nodes = replicas or p.get("replicas", 1), trainer_nodes or p.get("trainer_nodes")
    if not (config and trainer and inference and trainer_nodes):
        raise ValueError("simulate needs --config, --trainer, --inference and --trainer-nodes (or a --preset)")
    spec = model_spec(load_config(config), name=str(config).rsplit("/", 1)[-1].removesuffix(".json"))
    top = Topology.build(trainer=trainer, inference=inference, replicas=replicas, trainer_nodes=trainer_nodes,
                         gpn=gpus_per_node, experts=spec.experts, colocate=colocate)
    fractions = p.get("delta", ()) if changed_fractions is None else changed_fractions
    models = [DeltaModel(fraction=f, encode_gbps=encode_gbps, decode_gbps=decode_gbps) for f in fractions]
    r = simulate(spec, top, nic_gbps=nic_gbps, nvlink_gbps=nvlink_gbps, record=record, recv_budget=recv_budget,
                 delta=models)
    if p.get("seed"):
        r["seed"] = p["seed"]
        scale_seed(r)
    print(table(r, top, recv_slots=RECV_SLOTS, lookahead=LOOKAHEAD))
    if as_json:
        emit_json(r)
    return r


def calibrate_cpu(measured: dict[str, Any], *, groups: int | None = None, copy_bps: float = CPU_COPY_BPS,
                  rtt_s: float = CPU_RTT_S) -> dict[str, Any]:
    """Predict ``shardsync bench --json``'s ``shardsync_s`` with the same time model: every flow shares
    the one loopback link (``link_gbps``, GB/s); groups move in lockstep, pack of g+1 and apply of g-1
    overlap g's transfer; fill and drain added. Groups default to the bench model's layers + pre + post."""
    if groups is None:
        from .bench import PRESETS as BENCH

        cfg = BENCH.get(measured.get("model", "qwen3-moe-bench"))
        groups = cfg.layers + 2 if cfg is not None else 6
    link = measured["link_gbps"] * 1e9
    per_c = list(measured["bytes_per_consumer"])
    total = sum(per_c)
    replicas = measured.get("replicas", 2)
    xfer = total / groups / link + 2 * rtt_s              # WaitReady + Released per group
    pack = total / replicas / groups / copy_bps            # one copy per distinct plan (bench: 2 replicas)
    apply_ = max(per_c) / groups / copy_bps
    predicted, _ = pipeline_time([xfer] * groups, [pack] * groups, [apply_] * groups)
    out = {"predicted_s": _sig(predicted), "sol_s": round(total / link, 4), "groups": groups}
    if "shardsync_s" in measured:
        out["measured_s"] = measured["shardsync_s"]
        out["rel_error"] = round(predicted / measured["shardsync_s"] - 1, 4)
    return out


def run(args) -> int:
    """``shardsync simulate``: 2 on a bad configuration (the reason on stderr)."""
    try:
        run_simulate(config=args.config, preset=args.preset, trainer=args.trainer, inference=args.inference,
                     replicas=args.replicas, trainer_nodes=args.trainer_nodes, gpus_per_node=args.gpus_per_node,
                     nic_gbps=args.nic_gbps, nvlink_gbps=args.nvlink_gbps, as_json=args.json, record=args.record,
                     colocate=args.colocate, encode_gbps=args.encode_gbps, decode_gbps=args.decode_gbps,
                     changed_fractions=None if args.changed_fraction is None else parse_fractions(args.changed_fraction))
    except ValueError as e:
        print(f"shardsync simulate: {e}", file=sys.stderr)
        return 2
    return 0
