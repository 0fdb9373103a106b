"""Reading a plan's writes back from the parameters (``plan/readback.py``, ``GroupUnpacker.read_back``): where a
scatter's region is its own, the bytes packed again from the parameters are the bytes the producer packed."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import zoo_roundtrip
from shardsync.plan.pack import GroupPacker, layout_group
from shardsync.plan.readback import ParamsReadBack, own_region, readable_scatters
from shardsync.testing.harness.consumers import ZooConsumer
from shardsync.testing.zoo import ZooConfig, hf_state_dict


def _packed(plan, sd):
    """Each group's buffer as a delta producer packs it: zeroed, then its slices."""
    out = {}
    for g in plan.groups:
        lay = layout_group(g)
        buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
        GroupPacker(g, lay).pack(sd, buf)
        out[g.name] = (lay, buf)
    return out


def _check_read_back(cfg: ZooConfig, tp: int, seed: int = 0) -> tuple[int, int]:
    """Sync ``cfg`` into fresh zoo ranks, read every readable chunk back and compare with the packed bytes;
    returns (readable scatters, scatters) over the ranks."""
    sd = hf_state_dict(cfg, seed=seed)
    bad, _, plans = zoo_roundtrip(cfg, sd, tp)
    assert bad == [[]] * tp
    readable = total = 0
    for r, plan in enumerate(plans):
        z = ZooConsumer(cfg, f"tp{r}", tp=tp, tp_rank=r)
        z.live.load_weights(sd.items())  # what the sync wrote (zoo_roundtrip's models are not returned)
        rb = ParamsReadBack(plan, z.params, z.params.keys())
        for name, (lay, buf) in _packed(plan, sd).items():
            ok = rb.readable.get(name, frozenset())
            total += len(plan.group(name).scatters)
            readable += len(ok)
            for c in lay.chunks:
                if c.stop > c.first and all(i in ok for i in range(c.first, c.stop)):
                    got = torch.full((c.nbytes,), 0xA5, dtype=torch.uint8)  # gaps must come back zeroed
                    rb.read_back(name, c, got)
                    assert torch.equal(got, buf[c.start: c.start + c.nbytes]), (name, c.index)
    return readable, total


def test_a_dense_model_reads_back_every_scatter_and_the_bytes_are_the_packed_ones() -> None:
    readable, total = _check_read_back(ZooConfig.llama_tiny(fused_qkv=True, fused_gate_up=True), tp=2)
    assert readable == total > 0


def test_parameters_sharing_a_storage_are_not_read_back_and_the_rest_is() -> None:
    """Two written parameters on one storage (tied, aliased): neither region is its own; everything else is. A
    tied embedding written once (its checkpoint has no LM head) is."""
    cfg = ZooConfig.llama_tiny()
    _, _, plans = zoo_roundtrip(cfg, hf_state_dict(cfg), 1)
    z = ZooConsumer(cfg, "tp0")
    a, b = "model.layers.0.input_layernorm.weight", "model.norm.weight"
    aliased = {**z.params, b: z.params[a]}
    ok = readable_scatters(plans[0], aliased, aliased.keys())
    both = [(g.name, i) for g in plans[0].groups for i, s in enumerate(g.scatters) if s.dst in (a, b)]
    assert len(both) == 2 and not any(i in ok.get(g, ()) for g, i in both)
    assert sum(map(len, ok.values())) == sum(len(g.scatters) for g in plans[0].groups) - 2
    readable, total = _check_read_back(ZooConfig.llama_tiny(tie=True), tp=1)
    assert readable == total > 0


def test_only_eligible_parameters_and_a_plan_without_fallbacks_are_read_back() -> None:
    cfg = ZooConfig.llama_tiny()
    _, _, plans = zoo_roundtrip(cfg, hf_state_dict(cfg), 1)
    z = ZooConsumer(cfg, "tp0")
    norms = [n for n in z.params if "norm" in n]
    ok = readable_scatters(plans[0], z.params, norms)
    assert ok and all(g.scatters[i].dst in norms for g in plans[0].groups for i in ok.get(g.name, ()))
    missing = {n: t for n, t in z.params.items() if n != norms[0]}  # a write into a tensor not given: unknown
    assert readable_scatters(plans[0], missing, z.params.keys()) == {}


def test_own_region() -> None:
    assert own_region((4, 8), (8, 1)) and own_region((4, 8), (1, 4)) and own_region((3, 1, 5), (5, 0, 1))
    assert not own_region((4, 8), (0, 1)) and not own_region((4, 8), (4, 1)) and own_region((), ())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), kv=st.sampled_from([1, 2, 4]), vocab=st.integers(65, 300),
       layout=st.sampled_from(["per_expert", "mixtral", "fused_t", "dense"]), fused=st.booleans(),
       tie=st.booleans(), ckpt_dtype=st.sampled_from(["bfloat16", "float32"]), seed=st.integers(0, 9))
def test_random_layouts_read_back_exactly(tp, kv, vocab, layout, fused, tie, ckpt_dtype, seed) -> None:
    experts = 0 if layout == "dense" else 4
    cfg = ZooConfig(vocab=vocab, hidden=16, layers=1, heads=4, kv_heads=kv, head_dim=4, inter=8 * tp,
                    experts=experts, moe_inter=4 * tp, moe_layout=layout if experts else "per_expert",
                    fused_qkv=fused, fused_gate_up=fused, tie=tie, ckpt_dtype=ckpt_dtype)
    readable, total = _check_read_back(cfg, tp, seed)
    assert 0 < readable <= total
