"""Source reads: a consumer that maps its producer's memory scatters each group straight from the trainer's tensors
(no pack pass, no ring slot), from the second sync on, for tensors that stay the same objects.

The engine path is the one ``cuda_ipc`` takes on a GPU (``tests/gpu/test_gpu.py``, ``benchmarks/gpu_sync.py`` run it on
the device); here the in-process ``loopback`` transport shares the CPU tensors: a real producer and consumers (threads),
every sync compared byte for byte with the zoo's own loaders on the full tensors of that version.
"""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch

from shardsync.engine.protocol import messages as m
from shardsync.plan.groups import base_group
from shardsync.engine.consumer import puller as puller_mod
from shardsync.engine.producer.producer import Producer, ProducerConfig
from shardsync.engine.source_reads.source_open import SourceOpener
from shardsync.errors import SyncError
from shardsync.source import ModuleSource
from shardsync.transport.loopback import LoopbackTransport
from shardsync.types import ParamMeta
from shardsync.testing.zoo import hf_state_dict

from test_wire import CFG, TOKEN, _catch, _close, _start, _sync, _Zoo


class _InPlace(ModuleSource):
    """A trainer whose weights are updated in place (an optimizer step): the same tensor objects every sync."""

    def at(self, v: int) -> None:
        for n, t in dict(hf_state_dict(CFG, seed=v)).items():
            self._state[n].copy_(t)


class _OneBuffer(_InPlace):
    """A source that gathers every batch into one reused flat buffer, yielding the same view objects every sync (a
    valid source: a batch's tensors are dropped before the next one is gathered), but the next batch overwrites the
    memory of the last: no group may be read where it lies."""

    def __init__(self, state):
        super().__init__(state)
        batches = super().groups()
        buf = torch.empty(max(sum(self._state[n].nbytes for n in b) for b in batches) + 64 * 64, dtype=torch.uint8)
        self._views = {}
        for b in batches:
            off = 0
            for n in b:
                t = self._state[n]
                self._views[n] = buf[off: off + t.nbytes].view(t.dtype).view(t.shape)
                off += (t.nbytes + 63) // 64 * 64

    def iter_groups(self):
        for names in self.groups():
            yield names, [self._views[n].copy_(self._state[n]) for n in names]


def _producer(n: int, source_cls=_InPlace, **kw):
    kw = {"lease_s": 2.0, "timeout_s": 10.0, "init_timeout_s": 30.0, "transport": "loopback", "source_reads": True,
          **kw}
    p = Producer(source_cls(dict(hf_state_dict(CFG, seed=0))),
                 ProducerConfig(rank=0, n_producers=1, n_consumers=n, token=TOKEN, max_chunk_bytes=32 << 10, **kw))
    err: list = []
    th = threading.Thread(target=lambda: _catch(p.init, err), daemon=True)
    th.start()
    return p, th, err


def _run(p, th, err, zoos, versions):
    _start(zoos)
    th.join(30)
    assert not err, err
    return _syncs(p, zoos, versions)


def _syncs(p, zoos, versions):
    """Sync ``versions`` in turn, each one complete and exact on every consumer; the stats of each."""
    out = []
    for v in versions:
        stats, errs = _sync(p, zoos, v)
        assert not errs, errs
        assert sorted(stats["completed"]) == sorted(z.c.id for z in zoos) and not stats["dropped"], stats
        assert [z.exact(v) for z in zoos] == [True] * len(zoos), v
        out.append((dict(stats), [dict(z.c.stats) for z in zoos]))
    return out


def test_direct_consumers_read_the_trainers_tensors_from_the_second_sync_and_stay_exact() -> None:
    p, th, err = _producer(2)
    zoos = [_Zoo(p.address, "r0/tp0", tp=2, rank=0, transport="loopback", direct_reads=True),
            _Zoo(p.address, "r0/tp1", tp=2, rank=1, transport="loopback", direct_reads=True)]
    try:
        runs = _run(p, th, err, zoos, (1, 2, 3, 4))
        groups = len(p.order)
        assert [r[0]["source_groups"] for r in runs] == [0, groups, groups, groups]
        for _, cons in runs[1:]:
            assert all(c["source_groups"] == groups and c["recv_bytes"] == 0 for c in cons), cons
        # a tensor the trainer re-allocates: its batch is checked again and packed that sync, then read in place
        name = next(n for n in p.source._state if "layers.1" in n)
        p.source._state[name] = p.source._state[name].clone()
        st5, _ = _sync(p, zoos, 5)
        repacked = sum(base_group(g) == "model.layers.1" for g in p.order)  # its group, or every part of it
        assert repacked >= 1
        assert [z.exact(5) for z in zoos] == [True, True] and st5["source_groups"] == groups - repacked, st5
        st6, _ = _sync(p, zoos, 6)
        assert [z.exact(6) for z in zoos] == [True, True] and st6["source_groups"] == groups, st6
    finally:
        _close(p, zoos)


def test_the_ring_is_released_while_every_group_is_read_in_place_and_comes_back_when_one_is_not(monkeypatch) -> None:
    """Issue 37's memory item: no ring is held for groups every member reads where they lie. Released after the first
    version served wholly from the trainer's tensors; a group that cannot be read in place then (a re-allocated
    tensor) is served from a copy of its tensors; the ring comes back for the version after, and for a member that
    does not map the producer's memory. Every version exact."""
    sizes: list[int] = []
    new_ring = Producer._new_ring

    def spy(self, nbytes):
        ring = new_ring(self, nbytes)
        sizes.append(ring.numel())
        return ring

    monkeypatch.setattr(Producer, "_new_ring", spy)
    p, th, err = _producer(2)
    zoos = [_Zoo(p.address, "r0/tp0", tp=2, rank=0, transport="loopback", direct_reads=True),
            _Zoo(p.address, "r0/tp1", tp=2, rank=1, transport="loopback", direct_reads=True)]
    try:
        transport = p.transport
        runs = _run(p, th, err, zoos, (1, 2))
        opened = [z.c.sources.opened for z in zoos]
        assert min(opened) > 0
        runs += _syncs(p, zoos, (3,))
        full, groups = sizes[0], len(p.order)
        assert full == p.layout.n_slots * p.layout.slot_bytes > 64
        assert [r[0]["ring_released"] for r in runs] == [False, True, True]
        # the ring was swapped on the same transport: the storages it shared stay mapped, none is opened again
        assert p.transport is transport and [z.c.sources.opened for z in zoos] == opened
        assert runs[1][0]["ring_bytes"] == runs[2][0]["ring_bytes"] == 64 == p.ring.numel() and sizes == [full, 64]
        assert runs[2][0]["source_groups"] == groups and runs[2][0]["copied_groups"] == 0
        name = next(n for n in p.source._state if "layers.1" in n)
        p.source._state[name] = p.source._state[name].clone()  # re-allocated: not readable in place this sync
        st4, _ = _sync(p, zoos, 4)
        copied = sum(base_group(g) == "model.layers.1" for g in p.order)
        assert [z.exact(4) for z in zoos] == [True, True]
        assert st4["copied_groups"] == copied >= 1 and st4["source_groups"] == groups - copied and sizes == [full, 64], st4
        assert p.held_bytes() == 0 and p.layout.released
        st5, _ = _sync(p, zoos, 5)  # the ring back for one version (one was copied), then released again
        assert [z.exact(5) for z in zoos] == [True, True] and st5["copied_groups"] == 0, st5
        assert sizes == [full, 64, full, 64] and st5["ring_released"]
        late = _Zoo(p.address, "r1/tp0", tp=2, rank=0, transport="loopback", direct_reads=False)
        _start([late])
        zoos.append(late)
        st6, errs = _sync(p, zoos, 6)  # a member that reads packed groups: the ring is back before it begins
        assert not errs and [z.exact(6) for z in zoos] == [True, True, True], errs
        assert sizes == [full, 64, full, 64, full] and not st6["ring_released"] and st6["ring_bytes"] == full, st6
    finally:
        _close(p, zoos)


def test_a_consumer_that_does_not_map_the_producer_gets_packed_groups() -> None:
    p, th, err = _producer(2)
    zoos = [_Zoo(p.address, "r0/tp0", transport="loopback", direct_reads=True),
            _Zoo(p.address, "r1/tp0", transport="loopback", direct_reads=False)]
    try:
        runs = _run(p, th, err, zoos, (1, 2, 3))
        assert all(r[0]["source_groups"] == 0 for r in runs)
        assert runs[-1][1][1]["recv_bytes"] > 0
    finally:
        _close(p, zoos)


def test_a_slot_consumer_served_from_sources_packs_them_itself(monkeypatch) -> None:
    """The fallback for a consumer that said it maps the producer but reads through slots (a flag that changed
    between syncs): it packs the chunks from the mapped tensors into its slot; still exact."""
    init = puller_mod.Puller.__init__

    def claims(self, *a, **kw):
        init(self, *a, **kw)
        self.sources = True

    monkeypatch.setattr(puller_mod.Puller, "__init__", claims)
    p, th, err = _producer(1)
    zoos = [_Zoo(p.address, "r0/tp0", tp=2, rank=1, transport="loopback", direct_reads=False)]
    try:
        runs = _run(p, th, err, zoos, (1, 2, 3))
        assert runs[-1][0]["source_groups"] == len(p.order)
        assert runs[-1][1][0]["source_groups"] == len(p.order) and runs[-1][1][0]["recv_bytes"] > 0
    finally:
        _close(p, zoos)


def test_batches_sharing_one_gather_buffer_are_never_read_in_place() -> None:
    p, th, err = _producer(1, source_cls=_OneBuffer)
    zoos = [_Zoo(p.address, "r0/tp0", transport="loopback", direct_reads=True)]
    try:
        runs = _run(p, th, err, zoos, (1, 2, 3))
        assert p.same_batches.hits > 0  # the same objects every sync, yet overlapping: packed
        assert all(r[0]["source_groups"] == 0 for r in runs)
    finally:
        _close(p, zoos)


def test_source_reads_refuse_what_cannot_serve_them() -> None:
    with pytest.raises(SyncError, match="source_reads needs"):
        Producer(_InPlace(dict(hf_state_dict(CFG, seed=0))),
                 ProducerConfig(rank=0, n_producers=1, n_consumers=1, token=TOKEN, transport="loopback",
                                source_reads=True, mac=True))
    with pytest.raises(SyncError, match="source_reads needs"):
        Producer(_InPlace(dict(hf_state_dict(CFG, seed=0))),
                 ProducerConfig(rank=0, n_producers=1, n_consumers=1, token=TOKEN, transport="tcp", source_reads=True))


def _table(storages, rows) -> bytes:
    return msgspec.msgpack.encode(m.SourceTable(storages=storages, tensors=rows))


def test_forged_source_tables_are_refused_naming_the_tensor() -> None:
    t = LoopbackTransport()
    w = torch.arange(64, dtype=torch.bfloat16).view(8, 8)
    metas = [ParamMeta(name="w", dtype="bfloat16", shape=(8, 8))]
    try:
        desc = t.share(w)
        op = SourceOpener(t, metas, who="consumer c")
        got = op.tensors(0, "g", _table([desc], [("w", 0, 0)]), lambda: {"w"})
        assert torch.equal(got.tensors["w"], w)
        assert op.tensors(0, "g", _table([desc], [("w", 0, 0)]), lambda: {"w"}) is got  # the same bytes: kept
        assert op.tensors(0, "h", _table([desc], [("w", 0, 0)]), lambda: {"w"}).serial != got.serial
        bad = {
            "does not decode": b"\x93garbage",
            "names no tensor": _table([desc], [("x", 0, 0)]),
            "no storage": _table([desc], [("w", 3, 0)]),
            "does not fit": _table([desc], [("w", 0, 2)]),
            "aligned": _table([desc], [("w", 0, 1)]),
            "lacks tensors": _table([], []),
            "shared no tensor": _table([{"key": 10 ** 9}], [("w", 0, 0)]),
            "storages": _table([desc, desc], [("w", 0, 0)]),
        }
        for i, (why, blob) in enumerate(bad.items()):
            with pytest.raises(SyncError, match=why):
                op.tensors(0, f"g{i}", blob, lambda: {"w"})
        huge = b"\x92" + b"\x00" * op.max_table_bytes  # more than any honest table: refused before decoding
        with pytest.raises(SyncError, match=r"is \d+ bytes; a table of every tensor"):
            op.tensors(0, "huge", huge, lambda: {"w"})
    finally:
        t.close()


def test_a_consumer_requiring_keyed_tags_refuses_a_group_served_from_source_tensors() -> None:
    """Source reads carry no keyed tags: a consumer that requires them refuses such a ``Ready`` (a producer never
    serves one with ``mac``; one that does is not believed) before anything is mapped."""
    from types import SimpleNamespace

    from shardsync.engine.source_reads.source_open import SourceSink
    from shardsync.errors import ChunkMacError

    ctx = SimpleNamespace(id="c0", mac_required=lambda: True)
    inner = SimpleNamespace(holds_ring=True, takes_deltas=False)
    sink = SourceSink(inner, opener=None, ctx=ctx, p=0)
    ready = m.Ready(version=3, group="model.layers.0", chunks=[[0, -1, 64, -1]], sources=b"\x92\x90\x90")
    with pytest.raises(ChunkMacError, match="served group 'model.layers.0'.*from its source tensors"):
        sink.read(ready, check=None)


def test_sources_scatter_the_bytes_a_packed_buffer_does_and_a_missing_one_is_named() -> None:
    from shardsync.plan.pack import ChunkParts, GroupUnpacker, Sources, layout_group

    from test_direct_reads import _group_and_bytes

    z, g, buf = _group_and_bytes(CFG)
    full = dict(hf_state_dict(CFG, seed=3))
    lay = layout_group(g)
    ref = {n: torch.full_like(t, 7) for n, t in z.params.items()}
    GroupUnpacker(g, lay).unpack(buf, ref)
    for serial in (None, 5):
        got = {n: torch.full_like(t, 7) for n, t in z.params.items()}
        u = GroupUnpacker(g, lay)
        for _ in range(3):  # built, cached, replayed
            u.unpack(ChunkParts([(c, Sources(full, serial)) for c in lay.chunks]), got)
        assert all(torch.equal(ref[n].view(torch.uint8), got[n].view(torch.uint8)) for n in ref)
        short = {n: t for n, t in full.items() if n != g.scatters[-1].src}
        with pytest.raises(SyncError, match="source tensor .* missing"):
            GroupUnpacker(g, lay).unpack(ChunkParts([(c, Sources(short, serial)) for c in lay.chunks]), got)


def test_auto_shares_only_through_cuda_ipc() -> None:
    from shardsync.errors import TransportError
    from shardsync.transport.auto import AutoTransport

    t = AutoTransport()
    with pytest.raises(TransportError, match="CUDA tensors only"):
        t.share(torch.zeros(4))
    with pytest.raises(TransportError, match="not cuda_ipc"):
        t.open_shared(0, {})
