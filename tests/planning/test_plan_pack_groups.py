"""Pure planning: plan JSON round trip and digests, packed layouts, weight groups."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from hypothesis import given, strategies as st

from shardsync.errors import PlanError
from shardsync.plan.groups import group_order, weight_group
from shardsync.plan.pack import layout_group
from shardsync.plan.record import record_plan
from shardsync.source import ModuleSource
from shardsync.types import GroupPlan, Plan, Scatter
from shardsync.testing.zoo import ZooConfig, ZooModel, hf_state_dict

DIGEST_SCRIPT = """
from shardsync.plan.record import record_plan
from shardsync.source import ModuleSource
from shardsync.testing.zoo import ZooConfig, ZooModel, hf_state_dict
cfg = ZooConfig.qwen3_moe_tiny()
m = ZooModel(cfg, tp_size=2, tp_rank=1, ep_size=2, ep_rank=1)
p = record_plan(metadata=ModuleSource(hf_state_dict(cfg)).metadata(), load_weights=m.load_weights,
                params=dict(m.named_parameters()))
print(p.digest)
"""


def _plan(**kw) -> Plan:
    cfg = ZooConfig.qwen3_moe_tiny(**kw)
    m = ZooModel(cfg, tp_size=2, tp_rank=1, ep_size=2, ep_rank=1)
    return record_plan(metadata=ModuleSource(hf_state_dict(cfg)).metadata(), load_weights=m.load_weights,
                       params=dict(m.named_parameters()), consumer="r0/tp1")


def test_plan_json_round_trip() -> None:
    p = _plan()
    assert Plan.from_json(p.to_json()) == p
    assert Plan.from_dict(p.to_dict()) == p
    Plan.from_json(p.to_json()).verify_digest()


@pytest.mark.procs
def test_digest_identical_across_processes() -> None:
    out = subprocess.run([sys.executable, "-c", DIGEST_SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _plan().digest


def test_digest_changes_when_any_scatter_changes() -> None:
    p = _plan()
    seen = {p.digest}
    g0 = p.groups[1]
    s0 = g0.scatters[3]
    for change in ({"dst_byte_offset": s0.dst_byte_offset + 2}, {"shape": (1,) + s0.shape[1:]},
                   {"dst_dtype": "float16"}, {"src": s0.src + "x"}, {"ops": s0.ops[:-1]}):
        s1 = msgspec.structs.replace(s0, **change)
        g1 = msgspec.structs.replace(g0, scatters=g0.scatters[:3] + (s1,) + g0.scatters[4:])
        p1 = msgspec.structs.replace(p, groups=(p.groups[0], g1) + p.groups[2:])
        d = p1.content_digest()
        assert d not in seen
        seen.add(d)
        with pytest.raises(PlanError, match="digest"):
            p1.verify_digest()  # tampered content no longer matches the sealed digest
    assert _plan(ckpt_dtype="float32").digest != p.digest


def _scatter(nbytes: int) -> Scatter:
    return Scatter(src="x", ops=(), view=None, src_dtype="uint8", dst="p", dst_byte_offset=0, dst_dtype="uint8",
                   shape=(nbytes,), dst_stride=(1,))


@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
       align=st.sampled_from([1, 16, 64, 256]), max_chunk=st.integers(1, 20000))
def test_layout_properties(sizes: list[int], align: int, max_chunk: int) -> None:
    g = GroupPlan(name="g", scatters=tuple(_scatter(n) for n in sizes), nbytes=sum(sizes), sources=("x",))
    lay = layout_group(g, align=align, max_chunk_bytes=max_chunk)
    assert lay == layout_group(g, align=align, max_chunk_bytes=max_chunk)  # deterministic
    ends = 0
    for off, n in zip(lay.offsets, sizes):
        assert off % align == 0 and off >= ends  # aligned, ordered, non-overlapping
        ends = off + n
    assert lay.nbytes >= ends
    covered = []
    for c in lay.chunks:
        covered += range(c.first, c.stop)
        assert c.start == lay.offsets[c.first] and c.start + c.nbytes == lay.offsets[c.stop - 1] + sizes[c.stop - 1]
        assert c.nbytes <= max_chunk or c.stop - c.first == 1  # oversize only for a single slice
    assert covered == list(range(len(sizes)))


@pytest.mark.parametrize("name,group", [
    ("model.embed_tokens.weight", "pre"),
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0"),
    ("model.layers.12.mlp.experts.127.down_proj.weight", "model.layers.12"),
    ("model.layers.3.block_sparse_moe.experts.7.w1.weight", "model.layers.3"),  # Mixtral
    ("model.layers.60.self_attn.kv_a_proj_with_mqa.weight", "model.layers.60"),  # DeepSeek-V3
    ("model.layers.61.eh_proj.weight", "model.layers.61"),  # DeepSeek-V3 MTP layer
    ("language_model.model.layers.5.feed_forward.experts.gate_up_proj", "language_model.model.layers.5"),  # Llama-4
    ("vision_model.model.layers.5.mlp.fc1.weight", "vision_model.model.layers.5"),
    ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1"),  # Phi-3
    ("model.norm.weight", "post"),
    ("lm_head.weight", "post"),
    ("transformer.h.4.attn.c_attn.weight", "transformer.h.4"),
    ("transformer.wte.weight", "pre"),
])
def test_weight_group(name: str, group: str) -> None:
    assert weight_group(name) == group


def test_group_order() -> None:
    gs = ["post", "model.layers.10", "model.layers.2", "pre", "vision.layers.0"]
    assert group_order(gs) == ["pre", "model.layers.2", "model.layers.10", "vision.layers.0", "post"]


def test_packer_and_unpacker_reuse_views_only_while_tensors_stay_the_same() -> None:
    """Views are built once for tensors that stay the same objects (parameters, the ring): values written in
    place between calls still flow; a tensor replaced by a new object (an FSDP gather) is picked up, and none
    is kept alive by the cache."""
    import gc
    import weakref

    import torch

    from shardsync.plan.pack import GroupPacker, GroupUnpacker

    cfg = ZooConfig.qwen3_moe_tiny()
    full = {n: t.contiguous() for n, t in hf_state_dict(cfg, seed=1).items()}
    m = ZooModel(cfg, tp_size=2, tp_rank=1, ep_size=2, ep_rank=1)
    plan = record_plan(metadata=ModuleSource(full).metadata(), load_weights=m.load_weights,
                       params=dict(m.named_parameters()), consumer="c")
    g = plan.group("model.layers.0")
    lay = layout_group(g)
    pk, up = GroupPacker(g, lay), GroupUnpacker(g, lay)
    ring = torch.zeros(lay.nbytes + 128, dtype=torch.uint8)
    params = {n: p.detach() for n, p in m.named_parameters()}

    def roundtrip(src: dict) -> dict:
        pk.pack(src, ring[64: 64 + lay.nbytes])  # a new slice object each call, same bytes
        up.unpack(ring[64: 64 + lay.nbytes], params)
        ref = ZooModel(cfg, tp_size=2, tp_rank=1, ep_size=2, ep_rank=1)
        ref.load_weights([(n, t) for n, t in src.items() if n.startswith("model.layers.0.")])
        return {n: torch.equal(p, dict(ref.named_parameters())[n]) for n, p in params.items()
                if n.startswith("model.layers.0.")}

    assert all(roundtrip(full).values()) and all(roundtrip(full).values())  # second call: cached views
    for t in full.values():
        t.mul_(3).add_(1)  # in place: the cached views see it
    assert all(roundtrip(full).values())
    fresh = {n: t.clone() - 2 for n, t in full.items()}  # new objects: views rebuilt
    assert all(roundtrip(fresh).values())
    probe = weakref.ref(fresh[g.scatters[0].src])
    del fresh
    gc.collect()
    assert probe() is None, "the view cache kept a gathered tensor alive"
    params = {n: p.clone() for n, p in params.items()}  # new destination tensors: written, not the old ones
    assert all(roundtrip(full).values())
    for p in params.values():  # the same objects, new storage (a `.data` swap): written there, not the old storage
        p.data = torch.zeros_like(p)
    assert all(roundtrip(full).values())


def test_a_chain_with_a_copy_is_replayed_every_call_not_cached() -> None:
    """``index_select`` (an expert-parallel loader picking its experts with an index tensor) makes a copy, not a
    view: a cached copy would pack the first sync's values forever. Four in-place updates, four exact unpacks."""
    import torch

    from shardsync.plan.pack import GroupPacker, GroupUnpacker
    from shardsync.types import ParamMeta

    w = torch.randn(8, 6)
    live = {"p": torch.zeros(3, 6)}
    idx = torch.tensor([0, 3, 5])

    def load(weights) -> None:
        for _, t in weights:
            live["p"].copy_(t.index_select(0, idx))

    plan = record_plan(metadata=[ParamMeta(name="x", dtype="float32", shape=(8, 6))], load_weights=load,
                       params=live, consumer="c")
    g = plan.groups[0]
    assert g.scatters[0].view is None  # replayed op by op
    lay = layout_group(g)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    pk, up = GroupPacker(g, lay), GroupUnpacker(g, lay)
    for _ in range(4):
        w.add_(1.0)
        pk.pack({"x": w}, buf)
        up.unpack(buf, live)
        assert torch.equal(live["p"], w.index_select(0, idx))
