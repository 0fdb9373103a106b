"""The transfer engine with real processes: producers (PP shares) -> replicas x TP consumers."""

from __future__ import annotations

import pytest

from shardsync.errors import MetadataMismatch
from shardsync.testing.harness.cluster import LocalCluster
from shardsync.testing.harness.trainers import pp_share
from shardsync.plan.route import digest_of, holders_from_ownership, route_key, route_plans
from shardsync.plan.record import record_plan
from shardsync.source import ModuleSource
from shardsync.testing.zoo import ZooConfig, ZooModel, hf_state_dict

CFG = ZooConfig.qwen3_moe_tiny(layers=4)


@pytest.mark.procs
@pytest.mark.parametrize("transport", ["tcp", "nixl", "nccl:gloo"])
def test_two_producers_two_replicas_tp2_three_syncs_bit_exact(transport: str) -> None:
    """``nccl:gloo``: the nccl transport's pair groups (one per producer-consumer pair) over gloo on CPU."""
    name, _, backend = transport.partition(":")
    extra = {"transport_kwargs": {"backend": backend}} if backend else {}
    with LocalCluster(CFG, producers=2, replicas=2, tp=2, transport=name, lookahead=1,
                      max_chunk_bytes=64 << 10, timeout_s=60, producer_extra=extra, consumer_extra=extra) as cl:
        for v in (1, 2, 3):
            r = cl.sync(v)
            assert r["exact"], [c["mismatched"][:3] for c in r["consumers"]]
            sent = [p["bytes_sent"] for p in r["producers"]]
            assert min(sent) > 0.8 * max(sent), sent  # PP halves: balanced
            for p in r["producers"]:  # instrumented: never more than lookahead + 1 groups resident
                assert 1 <= p["max_resident"] <= p["lookahead"] + 1, p
            recv = [c["bytes_received"] for c in r["consumers"]]
            assert sum(sent) == sum(recv)  # nothing is sent that no consumer pulls
            full = sum(t.nbytes for t in hf_state_dict(CFG).values())
            assert all(0.4 * full < b < 0.6 * full for b in recv), (recv, full)  # each TP rank: about half


def _plans(cfg: ZooConfig, tp: int, ep: int = 1):
    metas = ModuleSource(hf_state_dict(cfg)).metadata()
    plans = []
    for r in range(tp):
        m = ZooModel(cfg, tp_size=tp, tp_rank=r, ep_size=ep, ep_rank=r % ep)
        plans.append(record_plan(metadata=metas, load_weights=m.load_weights, params=dict(m.named_parameters())))
    return metas, plans


def test_routes_balance_across_holders_and_share_one_route_per_plan() -> None:
    metas, plans = _plans(CFG, tp=2)
    names = [m.name for m in metas]
    holders = holders_from_ownership([None, None], names)  # both producers hold everything (e.g. FSDP)
    routes, load = route_plans({p.digest: p for p in plans}, holders, {p.digest: 2 for p in plans},
                               max_chunk_bytes=16 << 10)
    assert set(load) == {0, 1} and min(load.values()) > 0.8 * max(load.values()), load
    for p in plans:  # a group stays on one producer when one holds it all
        assert all(len(set(per)) == 1 for per in routes[p.digest].values())


def test_routes_prefer_producers_on_the_consumers_node_over_balance() -> None:
    """Two producers holding everything on nodes A and B; the same plan on both nodes: each node's route key reads
    only from its own node's producer (rule 5); a node without a producer is balanced as before."""
    metas, plans = _plans(CFG, tp=1)
    holders = holders_from_ownership([None, None], [m.name for m in metas])
    d = plans[0].digest
    ka, kb, kc = route_key(d, "A"), route_key(d, "B"), route_key(d, "C")
    routes, load = route_plans({ka: plans[0], kb: plans[0], kc: plans[0]}, holders, {ka: 1, kb: 1, kc: 1},
                               max_chunk_bytes=16 << 10, prefer={ka: {0}, kb: {1}, kc: set()})
    assert {p for per in routes[ka].values() for p in per} == {0}
    assert {p for per in routes[kb].values() for p in per} == {1}
    assert {p for per in routes[kc].values() for p in per} == {0, 1}
    assert digest_of(ka) == d and route_key(d) == d


def test_routes_follow_pipeline_ownership_and_split_expert_parallel_groups() -> None:
    metas, plans = _plans(CFG, tp=2)
    names = [m.name for m in metas]
    pp = holders_from_ownership([pp_share(names, 0, 2), pp_share(names, 1, 2)], names)
    routes, _ = route_plans({p.digest: p for p in plans}, pp, {})
    for p in plans:
        assert set(routes[p.digest]["model.layers.0"]) == {0} and set(routes[p.digest]["model.layers.3"]) == {1}
    # EP trainer: experts of every layer split over two producers; the rest on both
    ep_held = [[n for n in names if ".experts." not in n or int(n.split(".experts.")[1].split(".")[0]) % 2 == r]
               for r in range(2)]
    routes, _ = route_plans({p.digest: p for p in plans}, holders_from_ownership(ep_held, names), {})
    assert all(set(per) == {0, 1} for p in plans for g, per in routes[p.digest].items() if g.startswith("model.layers"))


def test_a_needed_name_without_an_owner_fails_clearly() -> None:
    metas, plans = _plans(CFG, tp=1)
    names = [m.name for m in metas if m.name != "model.layers.2.mlp.gate.weight"]
    with pytest.raises(MetadataMismatch, match="'model.layers.2.mlp.gate.weight'.*no producer holds"):
        route_plans({plans[0].digest: plans[0]}, holders_from_ownership([names], names), {})
