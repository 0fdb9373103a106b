"""Simulator: presets reproduce the seed's figures; bytes are conserved; plans cover; EP; custom configs.

The presets run in ``template`` recording mode here (seconds instead of half a minute); that mode is
shown to give the very plans ``full`` mode gives (equal digests) on small models below.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from helpers import garbage, mismatched
from shardsync.plan.coverage import check_coverage
from shardsync.engine.inprocess import LocalConsumer, loopback_sync
from shardsync.plan.record import record_plan
from shardsync.programs.simulate import calibrate_cpu, pipeline_time, run_simulate
from shardsync.programs.sim_models import ModelSpec, Topology, expert_of, load_config, model_spec, record_plans
from shardsync.source import ModuleSource
from shardsync.testing.zoo import ZooConfig
from shardsync.testing.zoo.mla import MLAConfig, MLAModel, mla_metadata

JSON_KEYS = {"model_bytes", "abs_sol_s", "serial_pp_sol_s", "predicted_s", "per_consumer_bytes_max",
             "per_producer_bytes_max", "peak_recv_bytes", "peak_gather_bytes", "parallel_pp_s"}
TINY_HF = {  # DeepSeek-V3 layout in miniature: MLA with q-lora, 1 dense layer, shared + 8 routed experts
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 250, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96, "moe_intermediate_size": 32,
    "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def _run(**kw) -> tuple[dict, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r = run_simulate(as_json=True, **kw)
    text = out.getvalue()
    assert json.loads(text.strip().splitlines()[-1]) == json.loads(json.dumps(r))  # JSON is the last line
    return r, text


@pytest.fixture(scope="module")
def kimi() -> tuple[dict, str]:
    return _run(preset="kimi-k2-48n", record="template")


@pytest.fixture(scope="module")
def qwen() -> tuple[dict, str]:
    return _run(preset="qwen3-235b-4n", record="template")


def _close(x: float, ref: float, tol: float = 0.10) -> bool:
    return abs(x / ref - 1) <= tol


def test_kimi_reproduces_seed_figures(kimi) -> None:
    r, text = kimi
    assert JSON_KEYS <= r.keys()
    assert _close(r["model_bytes"], 2e12) and _close(r["abs_sol_s"], 1.25) and _close(r["serial_pp_sol_s"], 5.0)
    assert (r["producers"], r["consumers"], r["distinct_plans"]) == (256, 128, 32)
    assert r["per_consumer_bytes_min"] == r["per_consumer_bytes_max"]  # TP32/EP32: every rank the same size
    assert r["intra_node_bytes"] == 0  # trainer and inference nodes are disjoint
    assert r["abs_sol_s"] <= r["parallel_pp_s"] <= r["predicted_s"] and r["serial_pp_sol_s"] <= r["predicted_s"]
    assert "absolute SoL" in text and "parallel PP" in text and "bottleneck" in text


def test_qwen_preset_bytes_match_the_sharding(qwen) -> None:
    r, _ = qwen
    metas = model_spec(load_config("qwen3-235b-a22b")).metadata()
    expert = sum(m.nbytes for m in metas if expert_of(m.name) is not None)
    dense = sum(m.nbytes for m in metas) - expert
    assert _close(r["model_bytes"], 235.09e9 * 2, 0.01)
    assert (r["producers"], r["consumers"], r["distinct_plans"]) == (16, 16, 16)
    # DP16/EP16: attention etc. whole on every rank (TP1), 8 of every layer's 128 experts
    assert r["per_consumer_bytes_max"] == r["per_consumer_bytes_min"] == dense + expert // 16
    assert r["abs_sol_s"] <= r["serial_pp_sol_s"] <= r["predicted_s"]


@pytest.mark.parametrize("which", ["kimi", "qwen"])
def test_bytes_conserved(which: str, request) -> None:
    r, _ = request.getfixturevalue(which)
    assert r["producer_bytes_sum"] == r["consumer_bytes_sum"] == r["routed_bytes_sum"] == r["total_bytes"]
    assert r["inter_node_bytes"] + r["intra_node_bytes"] == r["total_bytes"]


def test_kimi_ep_ranks_get_only_their_experts() -> None:
    spec = model_spec(load_config("kimi-k2"))
    keys = [(32, 0, 32, 0), (32, 17, 32, 17)]
    for key, plan in record_plans(spec, keys, mode="template").items():
        experts = {expert_of(s.src) for g in plan.groups for s in g.scatters} - {None}
        assert experts == set(range(12 * key[3], 12 * key[3] + 12))  # 384 / 32 = 12 each, no other
        assert sum(1 for n in plan.unneeded if expert_of(n) is not None) == 60 * 372 * 3


SMALL = {
    "mla_q_lora": MLAConfig.tiny(layers=4, first_dense=1),
    "mla_no_q_lora_two_dense": MLAConfig.tiny(layers=5, first_dense=2, q_lora_rank=0, shared_experts=2),
    "mla_moe_every_other": MLAConfig.tiny(layers=4, first_dense=0, moe_freq=2, tie=True),
    "qwen3_moe": ZooConfig.qwen3_moe_tiny(layers=3),
    "llama_dense": ZooConfig.llama_tiny(layers=3),
}


def _spec(cfg) -> ModelSpec:
    arch = "DeepseekV3ForCausalLM" if isinstance(cfg, MLAConfig) else "zoo"
    return ModelSpec("small", arch, cfg, cfg.layers, cfg.experts)


LAYOUTS = [(case, tp, ep) for case in sorted(SMALL) for tp, ep in [(1, 1), (2, 1), (2, 2), (4, 4)]
           if ep == 1 or getattr(SMALL[case], "experts", 0)]  # expert parallelism only where there are experts


@pytest.mark.parametrize("case,tp,ep", LAYOUTS)
def test_plans_cover_params_and_template_equals_full(case: str, tp: int, ep: int) -> None:
    spec = _spec(SMALL[case])
    keys = [(tp, r, ep, r if ep > 1 else 0) for r in range(tp)]
    full = record_plans(spec, keys, mode="full")
    templ = record_plans(spec, keys, mode="template")
    per_expert = spec.experts // ep if spec.experts else 0
    for key, plan in full.items():
        assert templ[key].digest == plan.digest
        check_coverage(plan, dict(spec.consumer(key).named_parameters())).raise_if_incomplete()
        for g in plan.groups:  # EP: no consumer receives another EP rank's experts
            for s in g.scatters:
                e = expert_of(s.src)
                assert e is None or e // per_expert == key[3], (s.src, key)


def _mla_state(cfg: MLAConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {m.name: (torch.randn(m.shape, generator=g) * 0.5 + 0.01).to(getattr(torch, m.dtype))
            for m in mla_metadata(cfg)}


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (4, 4)])
@pytest.mark.parametrize("q_lora", [24, 0])
def test_mla_zoo_bit_exact(tp: int, ep: int, q_lora: int) -> None:
    cfg = MLAConfig.tiny(q_lora_rank=q_lora, vocab=203)  # 203: vocab padding rows are filled, not sent
    sd = _mla_state(cfg, seed=tp)
    src = ModuleSource(sd)
    refs, lives, consumers = [], [], []
    for r in range(tp):
        kw = dict(tp_size=tp, tp_rank=r, ep_size=ep, ep_rank=r if ep > 1 else 0)
        ref, dry, live = MLAModel(cfg, **kw), MLAModel(cfg, **kw), MLAModel(cfg, **kw)
        ref.load_weights(sd.items())
        garbage(live)
        plan = record_plan(metadata=src.metadata(), load_weights=dry.load_weights,
                           params=dict(dry.named_parameters()), consumer=f"tp{r}")
        consumers.append(LocalConsumer(plan, dict(live.named_parameters())))
        refs.append(ref), lives.append(live)
    loopback_sync(src, consumers)
    assert [mismatched(a.state_dict(), b.state_dict()) for a, b in zip(refs, lives)] == [[]] * tp


def test_custom_config_path_and_colocation(tmp_path) -> None:
    path = tmp_path / "tiny-dsv3.json"
    path.write_text(json.dumps(TINY_HF))
    kw = dict(config=str(path), trainer="tp2,pp2,ep2", inference="tp2,ep2", replicas=2, trainer_nodes=1,
              gpus_per_node=8)
    r, text = _run(**kw)
    assert JSON_KEYS <= r.keys() and r["model"] == "tiny-dsv3" and r["consumers"] == 4
    assert r["intra_node_bytes"] == 0 and r["producer_bytes_sum"] == r["consumer_bytes_sum"] > 0
    c, _ = _run(**kw, colocate=True)  # consumers on the trainer node: everything moves over NVLink
    assert c["inter_node_bytes"] == 0 and c["intra_node_bytes"] == r["total_bytes"]
    assert c["abs_sol_s"] < r["abs_sol_s"]


def test_topology_rank_arithmetic_and_errors() -> None:
    t = Topology.build(trainer="tp8,pp8,ep32,etp1", inference="tp32,ep32", replicas=4, trainer_nodes=32, gpn=8,
                       experts=384)
    assert (t.dp, t.producers, t.consumers, t.stage_size) == (4, 256, 128, 32)
    assert t.consumer_key(33) == (32, 1, 32, 1) and t.consumer_node(0) == 32 and t.consumer_node(127) == 47
    q = Topology.build(trainer="tp4,pp2,ep8", inference="dp16,ep16", replicas=1, trainer_nodes=2, gpn=8, experts=128)
    assert q.consumer_key(5) == (1, 0, 16, 5) and q.consumer_label(5) == "r0/dp5/tp0"
    with pytest.raises(ValueError, match="EP"):
        Topology.build(trainer="tp8,pp8", inference="tp32,ep16", replicas=1, trainer_nodes=32, gpn=8, experts=384)
    with pytest.raises(ValueError, match="cannot read"):
        Topology.build(trainer="tp8,xx2", inference="tp8", replicas=1, trainer_nodes=8, gpn=8, experts=0)
    with pytest.raises(ValueError, match="multiple"):
        Topology.build(trainer="tp8,pp3", inference="tp8", replicas=1, trainer_nodes=1, gpn=8, experts=0)


def test_pipeline_time_overlaps_prep_and_apply() -> None:
    t, steps = pipeline_time([1.0, 1.0, 1.0], [0.5, 2.0, 0.1], [0.1, 0.1, 3.0])
    assert steps == [2.0, 1.0, 1.0] and t == pytest.approx(0.5 + 4.0 + 3.0)


def test_calibrate_cpu_against_the_measured_bench() -> None:
    measured = {"model_bytes": 212941312, "consumers": 4, "producers": 2, "shardsync_s": 0.2217,
                "baseline_s": 0.7586, "bytes_per_consumer": [106576384] * 4, "link_gbps": 2.271, "sol_s": 0.1877}
    c = calibrate_cpu(measured)
    assert c["sol_s"] == pytest.approx(0.1877, rel=1e-3)
    assert c["sol_s"] < c["predicted_s"] and abs(c["rel_error"]) < 0.15


@pytest.mark.procs
def test_forked_workers_record_the_same_plans(monkeypatch) -> None:
    import shardsync.programs.sim_models as sm

    spec = _spec(SMALL["mla_q_lora"])
    keys = [(2, r, 2, r) for r in range(2)]
    serial = record_plans(spec, keys, mode="full")
    monkeypatch.setattr(sm, "_PARALLEL_MIN_WORK", 0)
    forked = record_plans(spec, keys, mode="full", workers=2)
    assert {k: p.digest for k, p in forked.items()} == {k: p.digest for k, p in serial.items()}
