"""Groups above the sync memory budget are split into parts (``plan/split.py``): the parts partition the group's
writes in order, each fits the budget where it can be cut, overlapping writes are never separated (so applying
the parts in any order gives the bytes the whole group gives), and a real plan split this way syncs exactly."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from helpers import raw
from shardsync.engine.inprocess import LocalConsumer, loopback_sync
from shardsync.plan.groups import base_group, group_order
from shardsync.plan.record import record_plan
from shardsync.plan.split import budget_for, part_bytes_for, split_group, split_groups
from shardsync.source import ModuleSource
from shardsync.types import Fill, GroupPlan, ParamMeta, Scatter, StridedView


def _scatter(src: str, dst: str, off: int, n: int) -> Scatter:
    return Scatter(src=src, ops=(), view=StridedView(offset=0, shape=(n,), stride=(1,)), src_dtype="uint8", dst=dst,
                   dst_byte_offset=off, dst_dtype="uint8", shape=(n,), dst_stride=(1,))


def _fill(src: str, dst: str, pos: int, off: int, n: int) -> Fill:
    return Fill(src=src, pos=pos, value=0, dst=dst, dst_byte_offset=off, dst_dtype="uint8", shape=(n,),
                dst_stride=(1,))


def _run(groups: list[GroupPlan], dsts: dict[str, int], order: list[int]) -> dict[str, list[int]]:
    """Apply ``groups`` in ``order`` to byte arrays: scatter i of source s writes a marker (its identity), a fill 0."""
    mem = {d: [-1] * n for d, n in dsts.items()}
    for gi in order:
        g = groups[gi]
        fills = {}
        for f in g.fills:
            fills.setdefault(f.pos, []).append(f)
        for i in range(len(g.scatters) + 1):
            for f in fills.get(i, ()):
                mem[f.dst][f.dst_byte_offset: f.dst_byte_offset + f.shape[0]] = [0] * f.shape[0]
            if i < len(g.scatters):
                s = g.scatters[i]
                mark = hash((s.src, s.dst_byte_offset, s.shape)) & 0xFFFF | 1
                mem[s.dst][s.dst_byte_offset: s.dst_byte_offset + s.shape[0]] = [mark] * s.shape[0]
    return mem


WRITE = st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 60), st.integers(1, 24), st.booleans())


@settings(max_examples=300, deadline=None)
@given(writes=st.lists(WRITE, min_size=1, max_size=30), part=st.integers(1, 80), seed=st.randoms())
def test_parts_partition_the_group_and_never_separate_overlapping_writes(writes, part, seed) -> None:
    scatters, fills = [], []
    for j, (dst, off, n, is_fill) in enumerate(writes):
        if is_fill:
            fills.append(_fill(f"s{j}", dst, len(scatters), off, n))
        else:
            scatters.append(_scatter(f"s{j}", dst, off, n))
    if not scatters:
        return
    g = GroupPlan(name="model.layers.3", scatters=tuple(scatters), nbytes=sum(s.nbytes for s in scatters),
                  sources=tuple(sorted({s.src for s in scatters})), fills=tuple(fills))
    parts = split_group(g, part)
    # a partition, in order, named for the group, each part a group of its own
    assert [s for p in parts for s in p.scatters] == list(g.scatters)
    assert sorted((f.src for p in parts for f in p.fills)) == sorted(f.src for f in fills)
    assert sum(p.nbytes for p in parts) == g.nbytes
    assert all(base_group(p.name) == g.name for p in parts)
    assert group_order(p.name for p in parts) == [p.name for p in parts]
    assert all(set(p.sources) == {s.src for s in p.scatters} for p in parts)
    # any order of the parts writes what the whole group writes
    dsts = {"a": 90, "b": 90, "c": 90}
    whole = _run([g], dsts, [0])
    order = list(range(len(parts)))
    seed.shuffle(order)
    assert _run(parts, dsts, order) == whole
    assert _run(parts, dsts, order[::-1]) == whole


def test_disjoint_writes_are_cut_to_the_budget_and_overlapping_ones_kept_together() -> None:
    experts = [_scatter(f"e{i}", "w13", 100 * i, 100) for i in range(8)]  # disjoint slices of one fused parameter
    g = GroupPlan(name="model.layers.0", scatters=tuple(experts), nbytes=800, sources=tuple(f"e{i}" for i in range(8)))
    parts = split_group(g, 250)
    assert [p.nbytes for p in parts] == [200, 200, 200, 200]
    assert [p.name for p in parts] == [f"model.layers.0#{k}" for k in range(4)]
    # a fill over the whole parameter then the slices on top of it: one part, whatever the budget
    g2 = GroupPlan(name="model.layers.0", scatters=tuple(experts), nbytes=800, sources=g.sources,
                   fills=(_fill("e0", "w13", 0, 0, 800),))
    assert len(split_group(g2, 250)) == 1
    assert split_group(g, 800) == [g] and split_group(g, 0) == [g]


def test_the_default_budget_is_a_tenth_of_the_model_capped_at_a_gib() -> None:
    small = [ParamMeta(name="w", dtype="bfloat16", shape=(1000, 1000))]
    big = [ParamMeta(name="w", dtype="bfloat16", shape=(1 << 17, 1 << 16))]
    assert budget_for(small, None) == 200_000 and part_bytes_for(small, None) == 100_000
    assert budget_for(big, None) == 1 << 30
    assert budget_for(small, 0) == 0 and part_bytes_for(small, 12345) == 6172


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(8, 64, 16), requires_grad=False)

    def load_weights(self, weights) -> None:
        for name, t in weights:  # one checkpoint tensor per expert, into one fused parameter (as vLLM's MoE)
            e = int(name.split(".")[-2])
            self.w[e].copy_(t)


def test_a_split_plan_syncs_exactly() -> None:
    metas = [ParamMeta(name=f"model.layers.0.experts.{e}.weight", dtype="float32", shape=(64, 16)) for e in range(8)]
    live = _Tiny()
    params = dict(live.named_parameters())
    plan = record_plan(metadata=metas, load_weights=live.load_weights, params=params)
    split = split_groups(plan, 3 * 64 * 16 * 4)
    assert [g.name for g in split.groups] == ["model.layers.0#0", "model.layers.0#1", "model.layers.0#2"]
    assert split.digest != plan.digest and split_groups(plan, 0) is plan
    ck = {m.name: torch.randn(64, 16) for m in metas}
    loopback_sync(ModuleSource(ck), [LocalConsumer(split, {n: p.detach() for n, p in params.items()})])
    for e in range(8):
        assert torch.equal(raw(live.w[e]), raw(ck[f"model.layers.0.experts.{e}.weight"]))
