"""Delta history (``shardsync.delta.history``): refused above its budget, bases only from committed versions, a
rolled-back version restored byte for byte (or dropped to dense when its undo did not fit), the consumer side
applying deltas against exactly the version it holds; and the delta package's imports stay in their wing."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from shardsync.delta import codec
from shardsync.delta.history import DeltaHistory, chunk_sizes
from shardsync.errors import DeltaBudgetError, DeltaError, DeltaFormatError, DeltaMismatch
from shardsync.plan.pack import layout_group
from shardsync.plan.record import record_plan
from shardsync.programs.sim_models import zoo_metadata
from shardsync.testing.zoo import ZooConfig, ZooModel

KEYS = {("d1", "g0", 0): 4096, ("d1", "g0", 1): 1000, ("d2", "g0", 0): 4096}


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _step(t: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    m = torch.rand(t.numel(), generator=g) < frac
    out[m] ^= 1
    return out


def test_refused_above_the_budget_naming_both_figures() -> None:
    need = 4096 + 1024 + 4096  # each chunk 64-byte aligned
    with pytest.raises(DeltaBudgetError) as ei:
        DeltaHistory(KEYS, budget_bytes=need - 1)
    assert (ei.value.budget, ei.value.need) == (need - 1, need)
    assert f"{need:,}" in str(ei.value) and f"{need - 1:,}" in str(ei.value)
    h = DeltaHistory(KEYS, budget_bytes=need)
    assert h.need == need and h.journal_bytes == 0
    assert DeltaHistory(KEYS, budget_bytes=10 * need).journal_bytes == need  # more journal than one copy is useless


def test_from_real_layouts() -> None:
    cfg = ZooConfig.llama_tiny()
    model = ZooModel(cfg, tp_size=2, tp_rank=0)
    plan = record_plan(metadata=zoo_metadata(cfg), load_weights=model.load_weights,
                       params=dict(model.named_parameters()), consumer="tp0", rank=0)
    layouts = {plan.digest: {g.name: layout_group(g, max_chunk_bytes=4096) for g in plan.groups}}
    sizes = chunk_sizes(layouts)
    assert sum(sizes.values()) == sum(c.nbytes for lay in layouts[plan.digest].values() for c in lay.chunks)
    first = next(iter(sizes))
    h = DeltaHistory.from_layouts(layouts, only=[first], budget_bytes=1 << 20)
    assert list(h.sizes) == [first]


def test_versions_chain_and_rollback_restores_the_base() -> None:
    h = DeltaHistory(KEYS, budget_bytes=1 << 20)
    v1 = {k: _bytes(n, i) for i, (k, n) in enumerate(KEYS.items())}
    h.begin(1)
    for k, t in v1.items():
        assert h.encode(k, t).header.kind == codec.DENSE  # no base yet
    h.commit(1)
    assert all(h.version(k) == 1 and torch.equal(h.held(k), t) for k, t in v1.items())

    h.begin(2)
    v2 = {k: _step(t, 0.01, 7) for k, t in v1.items()}
    k0 = ("d1", "g0", 0)
    e = h.encode(k0, v2[k0])
    assert e.header.kind == codec.PAIRS and e.header.base == 1
    with pytest.raises(DeltaError):
        h.encode(k0, v2[k0])  # encoded once per version
    h.encode(("d1", "g0", 1), _bytes(1000, 99))  # dense (all changed): journalled whole
    h.rollback()  # version 2 failed: version 1 stays the base, byte for byte
    assert all(h.version(k) == 1 and torch.equal(h.held(k), t) for k, t in v1.items())

    h.begin(3)
    encs = {k: h.encode(k, t) for k, t in v2.items()}
    h.commit(3)
    held = {k: t.clone() for k, t in v1.items()}  # a consumer that completed version 1
    for k, e in encs.items():
        codec.decode_(held[k], e, base=1)
        assert torch.equal(held[k], v2[k]) and h.version(k) == 3


def test_state_errors() -> None:
    h = DeltaHistory(KEYS, budget_bytes=1 << 20)
    k0 = ("d1", "g0", 0)
    with pytest.raises(DeltaError):
        h.encode(k0, _bytes(4096, 0))  # no version open
    h.begin(5)
    with pytest.raises(DeltaError):
        h.begin(6)
    with pytest.raises(DeltaError):
        h.encode(("nope", "g0", 0), _bytes(4096, 0))
    with pytest.raises(DeltaError):
        h.encode(k0, _bytes(100, 0))  # wrong size
    with pytest.raises(DeltaError):
        h.commit(6)
    h.commit(5)
    with pytest.raises(DeltaError):
        h.begin(5)  # versions only go up


def test_without_journal_room_a_rolled_back_chunk_loses_its_base() -> None:
    sizes = {("d", "g", 0): 4096, ("d", "g", 1): 4096}
    h = DeltaHistory(sizes, budget_bytes=8192 + 4096 + 64)  # room to undo one dense chunk, not two
    v1 = {k: _bytes(4096, i) for i, k in enumerate(sizes)}
    h.begin(1)
    for k, t in v1.items():
        h.encode(k, t)
    h.commit(1)
    h.begin(2)
    for i, k in enumerate(sizes):
        h.encode(k, _bytes(4096, 50 + i))  # all changed: dense, old bytes journalled while they fit
    h.rollback()
    a, b = sizes
    assert h.version(a) == 1 and torch.equal(h.held(a), v1[a])
    assert h.version(b) is None  # next time dense: a failed version never becomes a base
    h.begin(3)
    assert h.encode(b, v1[b]).header.kind == codec.DENSE


def test_consumer_side_apply_checks_version_and_checksum() -> None:
    k = ("d", "g", 0)
    prod, cons = DeltaHistory({k: 4096}, budget_bytes=1 << 16), DeltaHistory({k: 4096}, budget_bytes=1 << 16)
    v1 = _bytes(4096, 1)
    for v, t in ((1, v1), (2, _step(v1, 0.01, 2))):
        prod.begin(v)
        e = prod.encode(k, t, checksum=True)
        prod.commit(v)
        cons.begin(v)
        assert torch.equal(cons.apply(k, e), t)
        cons.commit(v)
    assert e.header.kind == codec.PAIRS
    # a delta against a version the consumer does not hold
    prod.begin(3)
    e3 = prod.encode(k, _step(v1, 0.01, 3), checksum=True)
    prod.rollback()
    cons.invalidate()
    cons.begin(3)
    with pytest.raises(DeltaMismatch):
        cons.apply(k, e3)
    cons.rollback()
    # a payload that decodes but yields other bytes than the producer's: checksum mismatch, rolled back
    cons2 = DeltaHistory({k: 4096}, budget_bytes=1 << 16)
    cons2.begin(1)
    cons2.apply(k, codec.dense(_step(v1, 0.5, 9), checksum=False))  # holds wrong "version 1" bytes
    cons2.commit(1)
    before = cons2.held(k).clone()
    prod2 = DeltaHistory({k: 4096}, budget_bytes=1 << 16)
    prod2.begin(1)
    prod2.encode(k, v1)
    prod2.commit(1)
    prod2.begin(2)
    e = prod2.encode(k, _step(v1, 0.01, 4), checksum=True)
    cons2.begin(2)
    with pytest.raises(DeltaMismatch):
        cons2.apply(k, e)
    cons2.rollback()
    assert torch.equal(cons2.held(k), before) and cons2.version(k) == 1
    cons2.begin(3)
    with pytest.raises(DeltaFormatError):  # hostile payload: refused before writing
        cons2.apply(k, codec.Encoded(e.header, e.payload[:-2]))
    assert torch.equal(cons2.held(k), before)


def test_the_delta_package_stays_in_its_wing() -> None:
    """delta/ sits beside plan/: it may use plan/, types and errors, never the engine, transports or tools."""
    pkg = pathlib.Path(__file__).resolve().parents[2] / "src" / "shardsync" / "delta"
    forbidden = ("shardsync.engine", "shardsync.transport", "shardsync.integrations", "shardsync.programs",
                 "shardsync.testing.zoo", "shardsync.cli", "torch.distributed", "..engine", "..transport", "..integrations",
                 "..tools", "..zoo")
    for f in pkg.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                ["." * node.level + (node.module or "")] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith(forbidden)], (f.name, names)


@pytest.mark.parametrize("frac", [0.2, 0.5])
def test_rollback_keeps_the_base_when_many_words_changed(frac: float) -> None:
    """Where more than a sixth of the words changed, the index journal would outgrow the chunk: the old bytes are
    journaled instead, so a journal the chunk's size always restores it (the base is not dropped)."""
    g = torch.Generator().manual_seed(5)
    old = torch.randint(0, 256, ((1 << 16) + 6,), dtype=torch.uint8, generator=g)
    new = old.clone()
    pick = torch.rand(new.numel() // 2, generator=g) < frac
    new.view(torch.int16)[pick] += 1
    key = ("d", "g", 0)
    h = DeltaHistory({key: new.numel()}, budget_bytes=2 * new.numel() + 64)
    h.begin(1)
    h.encode(key, old)
    h.commit(1)
    h.begin(2)
    assert h.encode(key, new).header.kind == codec.BITMAP
    h.rollback()
    assert torch.equal(h.held(key), old) and h.version(key) == 1


def test_a_group_encoded_at_once_equals_its_chunks_encoded_one_by_one() -> None:
    """``encode_many`` (a group's chunks together: one host sync on a GPU) gives each chunk the header and payload
    bytes ``encode`` gives it alone, places the payloads one after another in the area, refuses a chunk twice, and
    leaves the same bases; a rollback restores them all."""
    from shardsync.plan.pack import ALIGN

    one, many = (DeltaHistory(KEYS, budget_bytes=4 * 9216) for _ in range(2))
    v1 = {k: _bytes(n, i) for i, (k, n) in enumerate(KEYS.items())}
    for h in (one, many):
        h.begin(1)
        for k, t in v1.items():
            h.encode(k, t, checksum=True)
        h.commit(1)
    v2 = {k: _step(t, f, 7) for (k, t), f in zip(v1.items(), (0.001, 0.02, 0.9))}
    one.begin(2)
    singles = [one.encode(k, t, checksum=True) for k, t in v2.items()]
    many.begin(2)
    area = torch.zeros(8192, dtype=torch.uint8)
    got = many.encode_many([(k, t, True) for k, t in v2.items()], area=area)
    pos = 0
    for k, a, (b, at) in zip(KEYS, singles, got):
        assert a.header == b.header
        if a.header.kind == codec.DENSE:
            assert at is None and b.payload.data_ptr() == v2[k].data_ptr()  # dense: the chunk itself
        else:
            assert at == pos and torch.equal(a.payload, area[at: at + a.payload.numel()])
            pos = (at + a.payload.numel() + ALIGN - 1) // ALIGN * ALIGN
    assert [g[0].header.kind for g in got] == [codec.PAIRS, codec.BITMAP, codec.DENSE]
    for k in KEYS:
        assert torch.equal(one.held(k), many.held(k)) and torch.equal(many.held(k), v2[k])
    many.rollback()
    for k in KEYS:
        assert torch.equal(many.held(k), v1[k]) and many.version(k) == 1
    many.begin(3)
    with pytest.raises(DeltaError, match="twice"):
        many.encode_many([(k, v2[k], True) for k in (list(KEYS)[0],) * 2])


def test_a_delta_with_no_room_left_in_the_area_goes_dense_and_still_becomes_the_base() -> None:
    h = DeltaHistory(KEYS, budget_bytes=4 * 9216)
    v1 = {k: _bytes(n, i) for i, (k, n) in enumerate(KEYS.items())}
    h.begin(1)
    h.encode_many([(k, t, False) for k, t in v1.items()])
    h.commit(1)
    v2 = {k: _step(t, 0.05, 3) for k, t in v1.items()}
    h.begin(2)
    area = torch.full((64,), 5, dtype=torch.uint8)  # room for no payload of these
    got = h.encode_many([(k, t, True) for k, t in v2.items()], area=area)
    assert all(e.header.kind == codec.DENSE and at is None for e, at in got) and int(area.sum()) == 5 * 64
    h.commit(2)
    assert all(torch.equal(h.held(k), v2[k]) and h.version(k) == 2 for k in KEYS)
