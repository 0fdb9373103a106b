"""Loader zoo: the replayed plan gives destination bytes identical to running the loader on real tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import zoo_roundtrip
from shardsync.plan.coverage import check_coverage
from shardsync.testing.zoo import ZooConfig, ZooModel, hf_state_dict

CASES = {
    "llama_gqa": ZooConfig.llama_tiny(),
    "gqa_kv1_replicated": ZooConfig.llama_tiny(heads=8, kv_heads=1, head_dim=8),
    "phi3_fused_qkv_gate_up": ZooConfig.llama_tiny(fused_qkv=True, fused_gate_up=True),
    "tied_embeddings": ZooConfig.llama_tiny(tie=True),
    "vocab_padding": ZooConfig.llama_tiny(vocab=203),
    "fp32_ckpt_to_bf16": ZooConfig.llama_tiny(ckpt_dtype="float32"),
    "bf16_ckpt_to_fp32": ZooConfig.llama_tiny(dtype="float32"),
    "qwen3_moe_per_expert": ZooConfig.qwen3_moe_tiny(),
    "mixtral_experts": ZooConfig.qwen3_moe_tiny(moe_layout="mixtral"),
    "llama4_fused_transposed_experts": ZooConfig.qwen3_moe_tiny(moe_layout="fused_t"),
}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_zoo_bit_exact(case: str, tp: int) -> None:
    cfg = CASES[case]
    if cfg.heads % tp:
        cfg = ZooConfig(**{**cfg.__dict__, "heads": 8, "head_dim": 8})
    bad, report, plans = zoo_roundtrip(cfg, hf_state_dict(cfg, seed=tp), tp)
    assert bad == [[]] * tp
    assert all(b > 0 for b in report.bytes_per_consumer)
    for plan, model in zip(plans, [ZooModel(cfg, tp_size=tp, tp_rank=r) for r in range(tp)]):
        check_coverage(plan, dict(model.named_parameters())).raise_if_incomplete()
    if tp > 1:  # nothing is sent twice to one rank: each keeps about 1/tp of the sharded weights
        full = sum(t.numel() * torch.finfo(cfg.torch_dtype).bits // 8 for t in hf_state_dict(cfg).values())
        assert max(report.bytes_per_consumer) < full


@pytest.mark.parametrize("layout", ["per_expert", "mixtral", "fused_t"])
def test_expert_parallel_drops_other_ranks_experts(layout: str) -> None:
    cfg = ZooConfig.qwen3_moe_tiny(moe_layout=layout)
    bad, report, plans = zoo_roundtrip(cfg, hf_state_dict(cfg), tp=2, ep=2)
    assert bad == [[], []]
    for rank, plan in enumerate(plans):
        # experts 0-3 live on EP rank 0, 4-7 on rank 1: no scatter of a foreign expert
        for g in plan.groups:
            for s in g.scatters:
                if ".experts." in s.src and layout != "fused_t":
                    e = int(s.src.split(".experts.")[1].split(".")[0])
                    assert e // 4 == rank, (s.src, rank)
        if layout != "fused_t":
            assert len([n for n in plan.unneeded if ".experts." in n]) == 2 * 4 * 3  # 2 layers × 4 experts × 3
    if layout == "fused_t":  # fused 3-D tensor: only this rank's experts' slices are selected
        full_expert_bytes = sum(t.nbytes for n, t in hf_state_dict(cfg).items() if "experts" in n)
        assert all(sum(s.nbytes for g in p.groups for s in g.scatters if "experts" in s.src)
                   <= full_expert_bytes // 4 for p in plans)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.sampled_from([1, 2, 4]),
    ep=st.sampled_from([1, 2]),
    kv=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8]),
    vocab=st.integers(65, 300),
    hidden=st.sampled_from([16, 32]),
    layout=st.sampled_from(["per_expert", "mixtral", "fused_t", "dense"]),
    fused=st.booleans(),
    tie=st.booleans(),
    ckpt_dtype=st.sampled_from(["bfloat16", "float32", "float16"]),
)
def test_random_shapes_bit_exact(tp, ep, kv, head_dim, vocab, hidden, layout, fused, tie, ckpt_dtype) -> None:
    experts = 0 if layout == "dense" else 4
    cfg = ZooConfig(vocab=vocab, hidden=hidden, layers=1, heads=4, kv_heads=kv, head_dim=head_dim, inter=8 * tp,
                    experts=experts, moe_inter=4 * tp, moe_layout=layout if experts else "per_expert",
                    fused_qkv=fused, fused_gate_up=fused, tie=tie, ckpt_dtype=ckpt_dtype)
    bad, _, _ = zoo_roundtrip(cfg, hf_state_dict(cfg, seed=vocab), tp, ep if experts else 1)
    assert bad == [[]] * tp
