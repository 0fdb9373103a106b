"""shardsync on Ray: trainer actors (PP2) and engine actors find each other by the group's name (no ports), sync
exactly, and a killed engine actor is dropped and rejoins when restarted under its consumer id."""

from __future__ import annotations

import time
from dataclasses import asdict

import pytest
import ray

from shardsync.integrations.ray import EngineWatch, forget, lookup
from shardsync.integrations.ray.registry import NAMESPACE
from shardsync.testing.harness.ray_actors import RdtBuffer, RdtReader, TrainerRank, VllmEngine, ZooEngine, close_actors
from shardsync.testing.zoo import ZooConfig

CFG = asdict(ZooConfig.qwen3_moe_tiny(layers=2))
ZOO = {"kind": "zoo", "cfg": CFG}
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="shardsync-tests")
    yield
    ray.shutdown()


def _sync(trainers, engines, v):
    refs = [t.sync.remote(v) for t in trainers] + [e.sync.remote(v) for e in engines]
    out = ray.get(refs, timeout=600)
    return out[:len(trainers)], out[len(trainers):]


# Runs first, before the module's local Ray instance. It once failed after other Ray tests (the restarted engine's
# init not done in 120 s): the group's registry actor, placed with a *soft* affinity to producer 0's node, landed on
# another raylet (3 of 5 probes) and died with C, so the restarted engine's lookup found no group. publish() pins it
# (hard affinity) and the test asserts where it runs.
def test_multi_raylet_cluster_routes_to_same_node_producers_and_survives_a_lost_node() -> None:
    """A local cluster of raylets: data-parallel trainer ranks on nodes A and B (each holds every tensor), engines on
    A, B and C. The engines on A and B read only from their node's producer; C's reads from either. C's raylet is removed
    (its engine dies with it): the next version completes on A and B, exact; C comes back, its engine restarts and
    rejoins, exact."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    group = "policy-nodes"
    trainers, engines, watch = [], {}, None
    try:  # a raylet that fails to start still shuts the cluster down
        nodes = {n: cluster.add_node(num_cpus=2, resources={n: 10}) for n in ("A", "B", "C")}
        ray.init(address=cluster.address, log_to_driver=False, namespace="shardsync-tests")
        trainers = [TrainerRank.options(resources={n: 1}).remote(ZOO, r, 2, group=group, n_consumers=3, lease_s=30.0,
                                                                   timeout_s=60, replicated=True)
                    for r, n in enumerate(("A", "B"))]

        def engine(n: str):
            return ZooEngine.options(resources={n: 1}).remote(f"e{n}/tp0", CFG, 1, 0, group=group, timeout_s=60)

        engines = {n: engine(n) for n in ("A", "B", "C")}
        ray.get([a.init.remote() for a in trainers + list(engines.values())], timeout=240)
        # the group's registry lives on producer 0's node (A): on C it would die with C's raylet below and the
        # restarted engine's lookup would find no group
        registry = ray.get_actor(f"sync-group:{group}", namespace=NAMESPACE)
        assert ray.get(registry.node.remote(), timeout=30) == nodes["A"].node_id
        watch = EngineWatch(group)
        for n, e in engines.items():
            watch.watch(e, [f"e{n}/tp0"])
        for v in (1, 2):
            _, en = _sync(trainers, list(engines.values()), v)
            assert all(e["ok"] for e in en), en
        pulled = dict(zip(engines, (e["pulled_from"] for e in en)))
        # A and B read only from their own node's producer; C (no producer on its node) from either: its routes are
        # balanced against the loads known when it registered, so which one depends on the order the engines joined
        assert pulled["A"] == [0] and pulled["B"] == [1] and pulled["C"] and set(pulled["C"]) <= {0, 1}, pulled
        cluster.remove_node(nodes["C"])  # the raylet goes, and the engine with it
        t0 = time.monotonic()
        while not watch.evicted and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert [c for c, _ in watch.evicted] == ["eC/tp0"], watch.evicted
        tr, en = _sync(trainers, [engines["A"], engines["B"]], 3)
        assert all(e["ok"] for e in en) and "eC/tp0" not in tr[0]["completed"], (en, tr)
        assert all(c["mismatched"] == [] for c in ray.get([engines[n].check.remote() for n in "AB"]))
        nodes["C"] = cluster.add_node(num_cpus=2, resources={"C": 10})
        engines["C"] = engine("C")
        ray.get(engines["C"].init.remote(), timeout=120)
        _, en = _sync(trainers, list(engines.values()), 4)
        assert all(e["ok"] for e in en), en
        checks = ray.get([e.check.remote() for e in engines.values()])
        assert all(c["mismatched"] == [] and c["version"] == 4 for c in checks), checks
    finally:
        if watch is not None:
            watch.stop()
        if ray.is_initialized():
            forget(group)
            ray.shutdown()
        cluster.shutdown()


def test_trainer_actors_to_engine_actors_by_group_name_exact_and_a_killed_engine_rejoins(local_ray) -> None:
    """The lease is long (30 s): the killed actor is dropped at once because the watch sees Ray's actor death."""
    group = "policy-test"
    kw = dict(group=group, n_consumers=2, lease_s=30.0, timeout_s=60)
    trainers = [TrainerRank.remote(ZOO, r, 2, **kw) for r in range(2)]
    ids = ["r0/tp0", "r0/tp1"]
    engines = [ZooEngine.remote(ids[r], CFG, 2, r, group=group, timeout_s=60) for r in range(2)]
    try:
        ray.get([a.init.remote() for a in trainers + engines], timeout=180)
        watch = EngineWatch(group)
        for cid, e in zip(ids, engines):
            watch.watch(e, [cid])
        info = lookup(group, timeout_s=5)
        assert info["transport"] == "tcp" and len(info["token"]) == 32 and info["coordinator"][1] > 0
        for v in (1, 2):
            tr, en = _sync(trainers, engines, v)
            assert all(e["ok"] for e in en), en
            assert sum(t["bytes_sent"] for t in tr) == sum(e["bytes_received"] for e in en) > 0
            assert all(c["mismatched"] == [] and c["version"] == v for c in ray.get([e.check.remote() for e in engines]))
        ray.kill(engines[1])  # the engine actor dies: Ray's notice drops it at once, not the 30 s lease
        t0 = time.monotonic()
        while not watch.evicted and time.monotonic() - t0 < 15:
            time.sleep(0.05)
        assert [c for c, _ in watch.evicted] == [ids[1]] and "died" in watch.evicted[0][1], watch.evicted
        tr, en = _sync(trainers, engines[:1], 3)  # the next version goes on without it
        assert en[0]["ok"] and ids[1] not in tr[0]["completed"] and ids[0] in tr[0]["completed"], (en, tr)
        assert time.monotonic() - t0 < 20, "waited for the 30 s lease instead of Ray's death notice"
        assert ray.get(engines[0].check.remote())["mismatched"] == []
        engines[1] = ZooEngine.remote(ids[1], CFG, 2, 1, group=group, timeout_s=60)  # restarted, same consumer id
        ray.get(engines[1].init.remote(), timeout=120)
        watch.watch(engines[1], [ids[1]])
        tr, en = _sync(trainers, engines, 4)
        assert all(e["ok"] for e in en), en
        checks = ray.get([e.check.remote() for e in engines])
        assert all(c["mismatched"] == [] and c["version"] == 4 for c in checks), checks
        watch.stop()
    finally:
        close_actors(engines + trainers, group)


def test_rdt_transport_contract_between_actors(local_ray) -> None:
    """Ray Direct Transport (NIXL): exact ranges into the consumer's buffer, typed range errors, a killed producer
    actor fails the next read with TransportError (never a hang)."""
    n = 3 * (1 << 20) + 123
    prod = RdtBuffer.remote(n)
    reader = RdtReader.remote(ray.get(prod.register.remote(), timeout=60))
    for off, k in [(0, 0), (0, 64), (7, 1001), (n - 5, 5), (0, n), (1 << 20, 2 << 20)]:
        assert ray.get(reader.read.remote(off, k), timeout=120) == ("ok", True), (off, k)
    kind, err = ray.get(reader.read.remote(n - 10, 11), timeout=60)
    assert kind == "error" and err.startswith("TransportError") and "outside producer 0" in err, err
    ray.kill(prod)
    t0 = time.monotonic()
    kind, err = ray.get(reader.read.remote(0, 1 << 20, 10.0), timeout=60)
    assert kind == "error" and err.startswith("TransportError") and "producer 0" in err, err
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("transport", ["rdt"])
def test_trainer_actors_to_engine_actors_over_ray_direct_transport(local_ray, transport: str) -> None:
    group = f"policy-{transport}"
    trainers = [TrainerRank.remote(ZOO, r, 2, group=group, n_consumers=2, transport=transport, timeout_s=60)
                for r in range(2)]
    engines = [ZooEngine.remote(f"r0/tp{r}", CFG, 2, r, group=group, timeout_s=60) for r in range(2)]
    try:
        ray.get([a.init.remote() for a in trainers + engines], timeout=180)
        for v in (1, 2):
            tr, en = _sync(trainers, engines, v)
            assert all(e["ok"] for e in en), en
            assert sum(t["bytes_sent"] for t in tr) == sum(e["bytes_received"] for e in en) > 0
            checks = ray.get([e.check.remote() for e in engines])
            assert all(c["mismatched"] == [] and c["version"] == v for c in checks), checks
    finally:
        close_actors(engines + trainers, group)


@pytest.mark.vllm
def test_pp2_trainer_actors_into_a_real_vllm_engine_actor_exact_vs_fresh(local_ray, tmp_path) -> None:
    """A real vLLM engine inside a Ray actor (its own executor: vLLM's Ray executor refuses the CPU platform) finds
    the group by name; after each sync it equals a FRESH engine started on the trainer's weights of that version."""
    from shardsync.verify.checkpoints import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint("qwen3_moe", str(tmp_path / "qwen3_moe"))
    group = "policy-vllm"
    spec = {"kind": "checkpoint", "path": ckpt}
    trainers = [TrainerRank.remote(spec, r, 2, group=group, n_consumers=1, timeout_s=300) for r in range(2)]
    engine = VllmEngine.remote(ckpt, "vllm-ray", group=group)
    try:
        ray.get([a.init.remote() for a in [*trainers, engine]], timeout=600)
        for v in (1, 2):
            tr, (en,) = _sync(trainers, [engine], v)
            assert en["ok"] and sum(t["bytes_sent"] for t in tr) == en["bytes_received"] > 0, (tr, en)
            chk = ray.get(engine.check.remote(v), timeout=600)
            assert chk["exact"] and chk["compared"] > 20, chk
    finally:
        close_actors([engine, *trainers], group, timeout_s=60)
