"""Direct reads: a consumer whose transport maps a producer's ring into its process copies each group straight from
that ring into its parameters (no receive slot), and releases the ring slot only once the group is applied.

The engine path is the same one ``cuda_ipc`` takes on a GPU (``tests/gpu/test_gpu.py`` runs that on the device); here
the in-process ``loopback`` transport maps the ring on the CPU: a real producer and consumers (threads), every
sync compared byte for byte with the zoo's own loaders.
"""

from __future__ import annotations

import pytest
import torch

from shardsync.errors import SyncError
from shardsync.plan.pack import ChunkParts, GroupUnpacker, layout_group
from shardsync.testing.zoo import ZooConfig, hf_state_dict

from test_wire import CFG, _close, _producer, _start, _sync, _Zoo


def test_direct_and_slot_consumers_side_by_side_stay_exact_over_syncs() -> None:
    p, th, err = _producer(3, transport="loopback", lookahead=1)
    zoos = [_Zoo(p.address, "r0/tp0", tp=2, rank=0, transport="loopback", direct_reads=True),
            _Zoo(p.address, "r0/tp1", tp=2, rank=1, transport="loopback", direct_reads=True),
            _Zoo(p.address, "r1/tp0", transport="loopback", direct_reads=False)]
    try:
        _start(zoos)
        th.join(30)
        assert not err, err
        for v in (1, 2, 3):
            stats, errs = _sync(p, zoos, v)
            assert not errs, errs
            assert sorted(stats["completed"]) == ["r0/tp0", "r0/tp1", "r1/tp0"] and not stats["dropped"], stats
            assert [z.exact(v) for z in zoos] == [True, True, True], v
        direct, slotted = zoos[0].c.stats, zoos[2].c.stats
        assert direct["direct_from"] == [0] and direct["recv_bytes"] == 0, direct
        assert slotted["direct_from"] == [] and slotted["recv_bytes"] > 0, slotted
        chunked = sum(c.nbytes for lay in zoos[0].c.layouts.values() for c in lay.chunks)
        assert direct["bytes_received"] == chunked
    finally:
        _close(p, zoos)


def _few_changed(v: int) -> dict[str, torch.Tensor]:
    """Version ``v``: version 1's weights with one element of every tensor changed per version since."""
    state = dict(hf_state_dict(CFG, seed=1))
    for i in range(2, v + 1):
        for t in state.values():
            t.view(-1)[i * 7 % t.numel()] += 1
    return state


def test_delta_where_it_pays_direct_consumers_read_dense_and_always_reads_deltas() -> None:
    """``delta=True``: a consumer mapping the producer's ring reads it dense (no held copy) and says so, so the
    producer encodes only for the consumer that reads through receive slots; ``delta="always"`` makes a mapping
    consumer hold a copy and read deltas too. Every sync exact; versions change a few elements each."""
    p, th, err = _producer(3, transport="loopback", lookahead=1, delta=True)
    p.source.at = lambda v: setattr(p.source, "_state", _few_changed(v))
    zoos = [_Zoo(p.address, "r0/tp0", transport="loopback", direct_reads=True, delta=True),
            _Zoo(p.address, "r1/tp0", transport="loopback", direct_reads=True, delta="always"),
            _Zoo(p.address, "r2/tp0", transport="loopback", direct_reads=False, delta=True)]
    try:
        _start(zoos)
        th.join(30)
        assert not err, err
        for v in (1, 2, 3):
            _, errs = _sync(p, zoos, v)
            assert not errs, errs
            assert [z.mismatched(_few_changed(v)) for z in zoos] == [[], [], []], v
        auto, always, slotted = (z.c.stats for z in zoos)
        assert auto["direct_from"] == [0] and zoos[0].c.held is None and "delta_chunks" not in auto, auto
        assert auto["delta_from"] == [] and always["delta_from"] == slotted["delta_from"] == [0]  # the choice
        assert always["direct_from"] == [] and always["delta_chunks"] > 0 and always["delta_heals"] == 0, always
        assert slotted["delta_chunks"] > 0 and slotted["bytes_received"] * 10 < auto["bytes_received"], slotted
        assert p.stats["delta_offered"] > 0 and p.stats["delta_skipped"] == 0, p.stats
    finally:
        _close(p, zoos)


def test_a_consumer_without_direct_reads_on_cpu_uses_slots_by_default() -> None:
    """``direct_reads=None`` turns them on for GPU consumers only: a CPU consumer's ``apply`` keeps getting one
    group buffer."""
    p, th, err = _producer(1, transport="loopback")
    seen: list[type] = []
    z = _Zoo(p.address, "r0/tp0", transport="loopback")
    inner = z.c.apply
    z.c.apply = lambda g, buf: (seen.append(type(buf)), inner(g, buf))[1]
    try:
        _start([z])
        th.join(30)
        assert not err, err
        _, errs = _sync(p, [z], 1)
        assert not errs and z.exact(1), errs
        assert seen and set(seen) == {torch.Tensor}
        assert z.c.stats["direct_from"] == []
    finally:
        _close(p, [z])


def _group_and_bytes(cfg: ZooConfig):
    from shardsync.testing.harness.consumers import ZooConsumer
    from shardsync.plan.pack import GroupPacker
    from shardsync.types import ParamMeta

    full = dict(hf_state_dict(cfg, seed=3))
    z = ZooConsumer(cfg, "tp0", tp=2, tp_rank=0)
    plan = z.record([ParamMeta(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
                     for n, t in full.items()])
    g = max(plan.groups, key=lambda g: len(g.scatters))
    lay = layout_group(g)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    GroupPacker(g, lay).pack(full, buf)
    return z, g, buf


def test_chunk_parts_from_another_chunking_scatter_the_same_bytes() -> None:
    """A reader's chunks are cut where the holding producer changes, not where the unpacker's layout cuts: parts
    copied out of a scattered buffer land exactly where the whole group buffer does."""
    cfg = ZooConfig.qwen3_moe_tiny(layers=1)
    z, g, buf = _group_and_bytes(cfg)
    ref = {n: torch.full_like(t, 7) for n, t in z.params.items()}
    got = {n: torch.full_like(t, 7) for n, t in z.params.items()}
    GroupUnpacker(g, layout_group(g)).unpack(buf, ref)
    fine = layout_group(g, max_chunk_bytes=256)  # many small chunks, each at its own place in a "ring"
    assert len(fine.chunks) > 3
    ring = torch.zeros(buf.numel() + 64 * len(fine.chunks) * 2, dtype=torch.uint8)
    parts, pos = [], 128
    for c in reversed(fine.chunks):  # out of order in the ring
        ring[pos: pos + c.nbytes] = buf[c.start: c.start + c.nbytes]
        parts.append((c, ring[pos: pos + c.nbytes]))
        pos += c.nbytes + 64
    GroupUnpacker(g, layout_group(g)).unpack(ChunkParts(parts), got)
    assert all(torch.equal(ref[n].view(torch.uint8), got[n].view(torch.uint8)) for n in ref)


def test_chunk_parts_that_do_not_cover_the_group_are_refused() -> None:
    cfg = ZooConfig.qwen3_moe_tiny(layers=1)
    z, g, buf = _group_and_bytes(cfg)
    fine = layout_group(g, max_chunk_bytes=256)
    parts = [(c, buf[c.start: c.start + c.nbytes]) for c in fine.chunks]
    u = GroupUnpacker(g, layout_group(g))
    with pytest.raises(SyncError, match="cover scatters"):
        u.unpack(ChunkParts(parts[:-1]), dict(z.params))
    with pytest.raises(SyncError, match="does not match the layout"):
        short = [(c, d[: c.nbytes - 1]) if i == 1 else (c, d) for i, (c, d) in enumerate(parts)]
        u.unpack(ChunkParts(short), dict(z.params))
