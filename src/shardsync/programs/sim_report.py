"""The table ``shardsync simulate`` prints: bytes, buffers, times and bottlenecks of one sync, then the delta
predictions (:mod:`shardsync.programs.sim_delta`) when it was asked for changed fractions."""

from __future__ import annotations

from typing import Any

from .sim_models import Topology

__all__ = ["table", "delta_rows", "fmt_s", "fmt_b"]


def fmt_s(x: float) -> str:
    return f"{x:.3f}" if x >= 1e-3 else f"{x:.3g}"


def fmt_b(n: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n / 1e3:.1f} kB"


def table(r: dict[str, Any], top: Topology, *, recv_slots: int, lookahead: int) -> str:
    """The human table of one ``simulate`` result (its delta predictions too, when it has them)."""
    nic = r["nic_gbps"] / 8
    rows = [
        f"{r['model']} ({r['arch']}): {fmt_b(r['model_bytes'])} in {r['tensors']:,} tensors",
        top.describe(),
        f"links: NIC {r['nic_gbps']:g} Gbit/s ({nic:g} GB/s) per GPU, NVLink {r['nvlink_gbps']:g} GB/s per GPU",
        f"plans: {r['distinct_plans']} distinct (recorded '{r['record_mode']}' in {r['record_s']} s), "
        f"routed + laid out in {r['route_s']} s; {r['producers_used']} producers serve",
        "",
        f"{'bytes':<34}{'max':>12}{'inter-node':>14}{'intra-node':>14}",
        f"{'per consumer':<34}{fmt_b(r['per_consumer_bytes_max']):>12}"
        f"{fmt_b(r['per_consumer_inter_bytes_max']):>14}{fmt_b(r['per_consumer_intra_bytes_max']):>14}",
        f"{'per producer':<34}{fmt_b(r['per_producer_bytes_max']):>12}"
        f"{fmt_b(r['per_producer_inter_bytes_max']):>14}{fmt_b(r['per_producer_intra_bytes_max']):>14}",
        f"{'into one replica':<34}{fmt_b(r['replica_bytes']):>12}",
        f"{'all consumers (= all producers)':<34}{fmt_b(r['consumer_bytes_sum']):>12}"
        f"{fmt_b(r['inter_node_bytes']):>14}{fmt_b(r['intra_node_bytes']):>14}",
        f"{'peak receive buffer / consumer':<34}{fmt_b(r['peak_recv_bytes']):>12}   "
        f"{recv_slots} slots x largest group ({r['largest_group']})",
        f"{'peak gathered / producer':<34}{fmt_b(r['peak_gather_bytes']):>12}   (lookahead {lookahead} + 1) x "
        f"largest gathered group ({r['largest_gather_group']}); packed ring {fmt_b(r['peak_ring_bytes'])}",
        "",
        f"{'time':<34}{'seconds':>12}   bottleneck",
        f"{'absolute SoL':<34}{fmt_s(r['abs_sol_s']):>12}   {r['abs_sol_bottleneck']}",
        f"{'serial-PP SoL':<34}{fmt_s(r['serial_pp_sol_s']):>12}   {r['serial_pp_bottleneck']}",
        f"{'serial-PP schedule':<34}{fmt_s(r['predicted_s']):>12}   {r['predicted_bottleneck']}",
        f"{'shardsync, parallel PP (' + str(r['parallel_pp_streams']) + ' streams)':<34}"
        f"{fmt_s(r['parallel_pp_s']):>12}   "
        f"{r['parallel_pp_bottleneck']}; {fmt_b(r['parallel_pp_recv_bytes'])} receive buffers "
        f"(budget {fmt_b(r['recv_budget_bytes'])})",
    ]
    rows.append(f"per-group route balance: the busiest producer of {r['group_imbalance_group']} carries "
                f"{r['group_imbalance']:.2f}x its PP stage's mean (the lockstep schedule waits for it)")
    if r.get("seed"):
        rows.append(f"seed reference: {', '.join(f'{k} {v:g}' for k, v in r['seed'].items())}")
    rows += delta_rows(r)
    return "\n".join(rows)


def delta_rows(r: dict[str, Any]) -> list[str]:
    """One row per changed fraction: bytes per consumer, how many times fewer, both schedules' seconds."""
    ds = r.get("delta")
    if not ds:
        return []
    rows = ["", f"{'delta sync, changed fraction':<34}{'per consumer':>12}{'fewer':>9}{'parallel PP':>13}"
                f"{'serial-PP':>11}   bottleneck (parallel PP)"]
    for x in ds:
        rows.append(f"{format(x['changed_fraction'], '.1%'):<34}{fmt_b(x['per_consumer_bytes_max']):>12}"
                    f"{x['bytes_ratio']:>8.1f}x{fmt_s(x['parallel_pp_s']):>13}{fmt_s(x['predicted_s']):>11}   "
                    f"{x['parallel_pp_bottleneck']}")
    rows.append(f"(dense: {fmt_s(r['parallel_pp_s'])} s parallel PP, {fmt_s(r['predicted_s'])} s serial-PP; codec "
                f"encode {ds[0]['encode_gbps']:g} GB/s, decode {ds[0]['decode_gbps']:g} GB/s of dense bytes; memory: "
                f"history {fmt_b(ds[0]['history_bytes_per_producer_max'])} per producer, held copy "
                f"{fmt_b(ds[0]['held_bytes_per_consumer_max'])} per consumer)")
    if any("seed_scaled_s" in x for x in ds):
        rows.append(f"seed's measured {r['seed']['measured_s']:g} s (dense) scaled by the serial-PP schedule's "
                    "delta/dense: " + ", ".join(f"{x['changed_fraction']:.0%} -> {x['seed_scaled_s']:g} s" for x in ds))
    return rows
