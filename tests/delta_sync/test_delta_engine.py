"""Delta sync through the engine (``ProducerConfig.delta``, ``Consumer(delta=True)``): real processes.

Each version changes ~0.2 % of the zoo model's elements (``trainers.sparse_steps``); every sync is checked exact
against the zoo's own loaders by ``LocalCluster.sync``. Plus the wire entry checks (``delta.receiver.parse_offers``)
and the held copy's versioning, in-process.
"""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st
import pytest
import torch

from shardsync.delta.receiver import HeldChunks, parse_offers
from shardsync.errors import SyncError
from shardsync.plan.pack import Chunk, GroupLayout
from shardsync.testing.harness.cluster import LocalCluster
from shardsync.testing.zoo import ZooConfig

CFG = ZooConfig.qwen3_moe_tiny(layers=3)
LEASE = 2.0


def _by(r: dict) -> dict:
    return {c["consumer"]: c for c in r["consumers"]}


def _why(r: dict) -> list:
    return [(c["consumer"], c.get("error"), c["mismatched"][:3]) for c in r["consumers"]] + [r["failed"]]


@pytest.mark.procs
def test_delta_sync_exact_small_heals_restarts_and_rolls_back() -> None:
    spec = {"kind": "zoo", "cfg": asdict(CFG), "changed": 0.002}
    with LocalCluster(CFG, producers=2, replicas=2, tp=1, lease_s=LEASE, timeout_s=8 * LEASE,
                      max_chunk_bytes=32 << 10, spec=spec, delta=True,
                      producer_extra={"delta_budget_bytes": 64 << 20}) as cl:  # room for an undo journal
        r = cl.sync(1)
        assert r["exact"], _why(r)
        dense = {k: c["bytes_received"] for k, c in _by(r).items()}
        assert all(c["delta_chunks"] == 0 and c["delta_dense_chunks"] > 0 for c in r["consumers"])
        assert all(p["ring_bytes"] > 0 and p["delta_history_bytes"] > 0 for p in r["producers"])

        rings = []
        for v in (2, 3, 4):  # only the changed words travel
            r = cl.sync(v)
            assert r["exact"], _why(r)
            for k, c in _by(r).items():
                assert c["delta_dense_chunks"] == 0 and c["delta_heals"] == 0, c
                assert c["bytes_received"] * 10 <= dense[k], (k, c["bytes_received"], dense[k])
            rings.append([(p["ring_bytes"], p["delta_area_bytes"], p["delta_area_need_bytes"], p["slot_bytes"])
                          for p in r["producers"]])
        # version 2's deltas sized the areas (a quarter of each slot at first): from version 3 on, rings of dense
        # slots plus twice what one slot's deltas needed, swapped on the same transport; every delta still fit
        for (ring2, area2, need2, slot2), (ring3, area3, _, slot3), (ring4, area4, need4, _) in zip(*rings):
            floor = -(-((slot2 - area2) // 64) // 64) * 64  # 1/64 of the dense bytes, aligned
            assert 0 < need2 and area3 == max(2 * need2, floor) < area2, rings
            assert slot3 - slot2 == area3 - area2 and ring3 // slot3 == ring2 // slot2 > 1, rings
            assert need4 <= area4, rings

        # a payload byte flipped in transit: caught by the checksum, the dense bytes read in the same sync
        r = cl.sync(5, faults={"r0/tp0": {"flip_at_chunk": 1}})
        assert r["exact"], _why(r)
        assert _by(r)["r0/tp0"]["delta_heals"] == 1 and _by(r)["r0/tp0"]["delta_dense_chunks"] == 1
        assert _by(r)["r1/tp0"]["delta_heals"] == 0

        # a restarted consumer holds nothing: dense, exact; the other stays on deltas
        cl.kill("r1/tp0")
        cl.restart("r1/tp0")
        r = cl.sync(6)
        assert r["exact"], _why(r)
        assert _by(r)["r1/tp0"]["delta_chunks"] == 0 and _by(r)["r1/tp0"]["bytes_received"] == dense["r1/tp0"]
        assert _by(r)["r0/tp0"]["delta_dense_chunks"] == 0

        # a version that fails mid-serve (producer 1 dies): producer 0 rolls its history back (its journal restores
        # the bases), so the next version's deltas apply to what consumers hold (no checksum heal), all exact
        r = cl.sync(7, faults={1: {"die_after_groups": 1}}, tolerate=True)
        assert not r["exact"]
        cl.restart(1)
        for v in (8, 9):
            r = cl.sync(v)
            assert r["exact"], _why(r)
            assert all(c["delta_heals"] == 0 for c in r["consumers"]), r["consumers"]
        for k, c in _by(r).items():  # back on deltas from both producers
            assert c["delta_dense_chunks"] == 0 and c["bytes_received"] * 10 <= dense[k], c


@pytest.mark.procs
def test_delta_bases_read_back_from_the_parameters_keep_no_held_copy_and_heal() -> None:
    """``Consumer(read_back=)`` (a zoo rank: nothing processes its parameters): every chunk is live, so the consumer
    holds no copy of the model, only receive slots; each delta's base is packed again from the parameters. Exact
    on deltas; a payload flipped in transit, a failed version and weights changed behind the sync's back (the
    parameters are not the base the producer encoded against) all heal with the dense bytes."""
    spec = {"kind": "zoo", "cfg": asdict(CFG), "changed": 0.002}
    with LocalCluster(CFG, producers=2, replicas=1, tp=2, lease_s=LEASE, timeout_s=8 * LEASE,
                      max_chunk_bytes=32 << 10, spec=spec, delta=True, consumer_extra={"read_back": True}) as cl:
        r = cl.sync(1)
        assert r["exact"], _why(r)
        dense = {k: c["bytes_received"] for k, c in _by(r).items()}
        for c in r["consumers"]:
            assert c["delta_held_bytes"] == 0 and c["delta_live_bytes"] >= c["plan_bytes"] > 0, c  # + alignment
            assert 0 < c["recv_bytes"] < c["plan_bytes"], c  # slots, bounded: not a second model
        for v in (2, 3):
            r = cl.sync(v)
            assert r["exact"], _why(r)
            for k, c in _by(r).items():
                assert c["delta_chunks"] > 0 and c["delta_dense_chunks"] == 0 and c["delta_heals"] == 0, c
                assert c["bytes_received"] * 10 <= dense[k], (k, c["bytes_received"], dense[k])

        r = cl.sync(4, faults={"r0/tp0": {"flip_at_chunk": 1}})
        assert r["exact"], _why(r)
        assert _by(r)["r0/tp0"]["delta_heals"] == 1 and _by(r)["r0/tp1"]["delta_heals"] == 0

        r = cl.sync(5, faults={"r0/tp1": {"poke_params": True}})
        assert r["exact"], _why(r)
        poked = _by(r)["r0/tp1"]
        assert poked["delta_heals"] > 0 and poked["delta_heals"] == poked["delta_dense_chunks"], poked

        # a failed version with the default history (no undo journal): producer 0's chunks encoded in it have no
        # base next version and go dense once — never a delta against bytes no consumer committed (no heal)
        r = cl.sync(6, faults={1: {"die_after_groups": 1}}, tolerate=True)
        assert not r["exact"]
        cl.restart(1)
        for v in (7, 8):
            r = cl.sync(v)
            assert r["exact"], _why(r)
            assert all(c["delta_heals"] == 0 for c in r["consumers"]), (v, r["consumers"])
        for k, c in _by(r).items():  # back on deltas from both producers
            assert c["delta_dense_chunks"] == 0 and c["delta_heals"] == 0 and c["bytes_received"] * 10 <= dense[k], c
        for p in r["producers"]:  # the bases once (1.0x the served share), no journal
            assert 0 < p["delta_history_bytes"] == p["delta_budget_bytes"], p


def _layout() -> GroupLayout:
    c0 = Chunk(index=0, start=0, nbytes=4096, first=0, stop=1)
    c1 = Chunk(index=1, start=4096, nbytes=1000, first=1, stop=2)
    return GroupLayout(group="g", offsets=(0, 4096), chunks=(c0, c1), nbytes=5096)


def test_parse_offers_checks_entries() -> None:
    lay = _layout()
    ready = SimpleNamespace(chunks=[[0, 0, 4096, -1], [1, 4096, 1000, -1]], deltas=[[0, 8192, 1, 3, 7, 99, 0]])
    offers, bad = parse_offers(ready, lay, where="t")
    assert bad == 0 and offers[0][0] == 8192 and offers[0][1].count == 3 and offers[0][1].base == 7
    for forged in ([0, 8192, 9, 3, 7, 99, 0],       # unknown kind
                   [0, 8192, 1, 4000, 7, 99, 0],    # a payload larger than the chunk
                   [0, -1, 1, 3, 7, 99, 0],         # negative offset
                   [0, 8192, 1, 3, -7, 99, 0],      # base not a version
                   [0, 8192, 1, 3, 7, 99, 5],       # an unknown checksum hash
                   [1, 8192, 2, 600, 7, 99, 1]):    # count above the chunk's words
        offers, bad = parse_offers(SimpleNamespace(chunks=ready.chunks, deltas=[forged]), lay, where="t")
        assert offers == {} and bad == 1, forged  # that chunk is read dense
    for broken in ([[5, 0, 1, 0, 7, 99, 0]], [[0, 0, 1, 0, 7, 99, 0]] * 2, [[0, 0, 1, 0, 7, 99]],
                   [[0, 0, 1, 0, 7, 9, 0]] * 3):
        with pytest.raises(SyncError):
            parse_offers(SimpleNamespace(chunks=ready.chunks, deltas=broken), lay, where="t")


def test_held_chunks_version_only_on_commit() -> None:
    held = HeldChunks({"g": _layout()}, device=torch.device("cpu"))
    assert held.stats()["delta_held_bytes"] >= 5096
    held.begin()
    assert held.touch("g", 0) == (None, None)
    held.written("g", 0, 0xABC)
    held.commit(3)
    assert held.versions[("g", 0)] == 3 and held.versions[("g", 1)] is None
    held.begin()
    assert held.touch("g", 0) == (3, 0xABC)
    assert held.hashes[("g", 0)] is None  # unhashed while being written
    held.written("g", 0, 0xDEF)
    held.fail()  # a failed sync's bytes are no base, and their hash is no longer trusted
    assert held.versions[("g", 0)] is None and held.hashes[("g", 0)] is None
    assert held.parts("g").parts[1][1].numel() == 1000



@pytest.mark.procs
@pytest.mark.parametrize("mode", ["mac", "plain_consumers"])
def test_delta_with_keyed_tags_or_plain_consumers(mode: str) -> None:
    """``mac``: each delta-decoded chunk is also checked against its producer's keyed tag. ``plain_consumers``:
    consumers without ``delta`` read the dense bytes of delta producers' rings, and the producers, told so by every
    ``WaitReady``, encode nothing."""
    spec = {"kind": "zoo", "cfg": asdict(CFG), "changed": 0.002}
    kw = dict(mac=True, delta=True) if mode == "mac" else dict(producer_extra={"delta": True})
    with LocalCluster(CFG, producers=2, replicas=1, tp=2, lease_s=LEASE, timeout_s=8 * LEASE,
                      max_chunk_bytes=32 << 10, spec=spec, **kw) as cl:
        first = {}
        for v in (1, 2, 3):
            r = cl.sync(v)
            assert r["exact"], _why(r)
            for k, c in _by(r).items():
                first.setdefault(k, c["bytes_received"])
                if mode == "plain_consumers":
                    assert "delta_chunks" not in c and c["bytes_received"] == first[k], c
                elif v > 1:
                    assert c["delta_chunks"] > 0 and c["delta_heals"] == 0, c
                    assert c["bytes_received"] * 10 <= first[k], c
            if mode == "plain_consumers":  # told no member reads deltas, producers encode nothing and hold no bases
                assert all(p["delta_offered"] == 0 for p in r["producers"]), r["producers"]
                assert v == 1 or all(p["delta_skipped"] > 0 and p["delta_history_bytes"] == 0
                                     for p in r["producers"]), r["producers"]
            else:
                assert all(p["delta_offered"] > 0 for p in r["producers"]) or v == 1


def test_delta_sender_budget_refused_and_offers_only_smaller_deltas() -> None:
    from shardsync.delta.sender import DeltaSender
    from shardsync.errors import DeltaBudgetError

    lay = _layout()
    units = {"g": [SimpleNamespace(digest="d", chunk=c) for c in lay.chunks]}
    with pytest.raises(DeltaBudgetError):
        DeltaSender(units, device=torch.device("cpu"), budget_bytes=4096)
    need = 4096 + 1024  # both chunks, aligned
    for budget in (None, 2 * need):  # the default keeps the bases once, no journal; twice buys a whole journal
        s = DeltaSender(units, device=torch.device("cpu"), budget_bytes=budget)
        u = units["g"][0]
        region, area = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
        s.begin(1)
        assert s.offer("g", [(u, region, None)], area, 8192)[0] is None  # no base: dense only
        s.commit(1)
        assert s.stats()["delta_history_bytes"] == (need if budget is None else 2 * need), s.stats()
        s.begin(2)
        region[10] = 7
        entry = s.offer("g", [(u, region, None)], area, 8192)[0]
        assert entry is not None and entry[:5] == [0, 8192, 1, 1, 1]  # pairs, one word, against version 1
        s.rollback()  # version 2 failed: never a base
        if budget is None:  # no undo: the chunk has no base, its next version goes dense
            assert s.history.version(("d", "g", 0)) is None
            s.begin(3)
            assert s.offer("g", [(u, region, None)], area, 8192)[0] is None
        else:  # the journal restores version 1 byte for byte
            assert s.history.version(("d", "g", 0)) == 1 and int(s.history.held(("d", "g", 0)).sum()) == 0


def test_a_delta_that_does_not_fit_the_slots_area_goes_dense_and_still_becomes_the_base() -> None:
    """The delta area is a share of the slot: a payload larger than what is left of it is not written there; the
    chunk is offered dense (``delta_too_large``) and its bytes are the next version's base all the same."""
    from shardsync.delta.sender import DeltaSender, area_bytes, entry_payload_bytes

    assert area_bytes(4096) == 1024 and area_bytes(0) == 0
    lay = _layout()
    units = {"g": [SimpleNamespace(digest="d", chunk=c) for c in lay.chunks]}
    s = DeltaSender(units, device=torch.device("cpu"), budget_bytes=None)
    u = units["g"][0]
    region, area = torch.zeros(4096, dtype=torch.uint8), torch.full((64,), 9, dtype=torch.uint8)
    s.begin(1)
    s.offer("g", [(u, region, None)], area, 8192)[0]
    s.commit(1)
    s.begin(2)
    region[0:400:2] = 1  # 200 changed words: a 1,200-byte pairs payload, more than the 64 bytes left
    assert s.offer("g", [(u, region, None)], area, 8192)[0] is None
    assert s.stats()["delta_too_large"] == 1 and int(area.sum()) == 9 * 64  # the area was not written
    s.commit(2)
    s.begin(3)
    region[1000] = 5  # one more word: fits
    entry = s.offer("g", [(u, region, None)], area, 8192)[0]
    assert entry is not None and entry[4] == 2 and entry_payload_bytes(entry, 4096) == 6  # against version 2's bytes


def test_the_delta_area_is_sized_by_what_the_last_version_needed() -> None:
    """``DeltaSender.area_for``: nothing to say before a version with bases; then twice the most one slot's deltas
    needed (those that went dense for lack of room counted), within 1/64 and 1/2 of the dense bytes; it grows at
    once, shrinks only below a quarter; no area after a version no member read as deltas, a quarter again after a
    first version some member reads as deltas; a failed version changes nothing."""
    from shardsync.delta import codec
    from shardsync.delta.sender import DeltaSender, area_bytes
    from shardsync.plan.pack import ALIGN

    dense_slot = 1 << 15  # floor 512, first area 8,192, cap 16,384
    c = [Chunk(index=i, start=4096 * i, nbytes=4096, first=i, stop=i + 1) for i in range(4)]
    units = {"g": [SimpleNamespace(digest="d", chunk=x) for x in c]}
    s = DeltaSender(units, device=torch.device("cpu"), budget_bytes=None)
    s.area = area_bytes(dense_slot)
    regions = [torch.zeros(4096, dtype=torch.uint8) for _ in c]
    area = torch.zeros(dense_slot // 2, dtype=torch.uint8)

    def version(v: int, changed_words: int, *, fail: bool = False) -> list:
        s.begin(v)
        for r in regions:
            r[0: 2 * changed_words: 2] += 1
        got = s.offer("g", [(u, r, None) for u, r in zip(units["g"], regions)], area[: s.area], 0)
        s.rollback() if fail else s.commit(v)
        return got

    def need(words: int) -> int:  # four chunks' payloads, each at an aligned offset
        size = codec.payload_nbytes(codec.choose(4096, words), 4096, words)
        return 4 * ((size + ALIGN - 1) // ALIGN * ALIGN)

    version(1, 0)  # no bases: nothing learnt
    assert s.area_for(dense_slot) is None
    version(2, 10)  # 60 bytes of pairs a chunk
    assert s.stats()["delta_area_need_bytes"] == need(10) == 4 * ALIGN and s.stats()["delta_too_large"] == 0
    assert s.area_for(dense_slot) == dense_slot // 64  # twice the need is the floor
    assert s.area_for(dense_slot) is None  # acted on once
    s.area = dense_slot // 64
    version(3, 300, fail=True)  # a failed version says nothing (and, with no journal, leaves no bases)
    assert s.area_for(dense_slot) is None
    version(4, 0)  # read dense: no bases, nothing learnt
    assert s.area_for(dense_slot) is None
    got = version(5, 300)  # 856-byte bitmaps: none fits the 512-byte area
    assert got == [None] * 4 and s.stats()["delta_too_large"] == 4
    assert s.stats()["delta_area_need_bytes"] == need(300) and s.area_for(dense_slot) == 2 * need(300)  # grown
    s.area = 2 * need(300)
    got = version(6, 300)
    assert all(e is not None for e in got) and s.area_for(dense_slot) is None  # it fits: kept
    version(7, 2)  # the area is over four times what was needed: it shrinks to the floor
    assert s.area_for(dense_slot) == dense_slot // 64
    s.area = dense_slot // 64
    version(8, 1500)  # twice what the bitmaps need is above half the dense bytes: the cap
    assert need(1500) < dense_slot // 2 < 2 * need(1500) and s.area_for(dense_slot) == dense_slot // 2
    s.area = dense_slot // 2
    s.begin(9)  # no member reads deltas: the bases go, and the area
    for u in units["g"]:
        s.skip(u, "g")
    s.commit(9)
    assert s.area_for(dense_slot) == 0 and s.stats()["delta_history_bytes"] == 0
    s.area = 0
    version(10, 3)  # a member reads deltas again: a first version (no bases), the first area back
    assert s.area_for(dense_slot) == area_bytes(dense_slot)


def test_a_groups_chunks_are_offered_together_their_payloads_one_after_another() -> None:
    """``DeltaSender.offer`` takes a group's chunks at once (one host sync for all on a GPU): each delta's payload
    follows the last one in the slot's area at an aligned offset, a chunk without changes left to send is an empty
    delta, and a payload that no longer fits goes dense while a later smaller one still fits."""
    from shardsync.delta.sender import DeltaSender, entry_payload_bytes
    from shardsync.plan.pack import ALIGN

    c = [Chunk(index=i, start=4096 * i, nbytes=4096, first=i, stop=i + 1) for i in range(4)]
    units = {"g": [SimpleNamespace(digest="d", chunk=x) for x in c]}
    s = DeltaSender(units, device=torch.device("cpu"), budget_bytes=None)
    regions = [torch.zeros(4096, dtype=torch.uint8) for _ in c]
    area = torch.full((256,), 9, dtype=torch.uint8)
    s.begin(1)
    assert s.offer("g", [(u, r, None) for u, r in zip(units["g"], regions)], area, 8192) == [None] * 4
    s.commit(1)
    s.begin(2)
    regions[0][0:20:2] = 1    # 10 words: 60 bytes of pairs
    regions[1][0:200:2] = 1   # 100 words: 600 bytes, more than what is left of the area
    regions[3][0:6:2] = 1     # 3 words: 18 bytes, fits after chunk 0's
    got = s.offer("g", [(u, r, None) for u, r in zip(units["g"], regions)], area, 8192)
    assert got[1] is None and [e[0] for e in (got[0], got[2], got[3])] == [0, 2, 3]
    assert [e[3] for e in (got[0], got[2], got[3])] == [10, 0, 3]  # chunk 2 unchanged: an empty delta
    assert got[0][1] == 8192 and entry_payload_bytes(got[0], 4096) == 60
    assert got[3][1] == 8192 + ALIGN and entry_payload_bytes(got[3], 4096) == 18
    assert torch.equal(area[:40].view(torch.int32), torch.arange(0, 10, dtype=torch.int32))  # pairs: indices first
    assert s.stats()["delta_too_large"] == 1 and s.stats()["delta_offered"] == 3
    s.commit(2)
    for u, r in zip(units["g"], regions):  # every chunk's base is this version's bytes, offered or not
        assert torch.equal(s.history.held(("d", "g", u.chunk.index)), r)


def test_a_groups_deltas_are_read_side_by_side_and_checked_together_each_healing_alone() -> None:
    """``read_held``: the payloads a producer placed one after another in its delta area come in one read, are
    checked and applied together; a chunk whose delta fails its checksum is read dense alone (the others stay
    deltas), and the held copy ends equal to the producer's bytes."""
    from shardsync.delta.receiver import read_held
    from shardsync.delta.sender import DeltaSender

    c = [Chunk(index=i, start=4096 * i, nbytes=4096, first=i, stop=i + 1) for i in range(4)]
    lay = GroupLayout(group="g", offsets=tuple(x.start for x in c), chunks=tuple(c), nbytes=4 * 4096)
    units = {"g": [SimpleNamespace(digest="d", chunk=x) for x in c]}
    ring = torch.zeros(4 * 4096 + 4096, dtype=torch.uint8)  # the dense chunks, then the slot's delta area
    dense, area = ring[: 4 * 4096], ring[4 * 4096:]
    s = DeltaSender(units, device=torch.device("cpu"), budget_bytes=None)
    held = HeldChunks({"g": lay}, device=torch.device("cpu"))
    reads: list = []

    def fetch(off, n, dst, payload=False):
        reads.append((off, n, payload))
        dst.copy_(ring[off: off + n])

    def sync(v, bad=()):
        s.begin(v)
        entries = s.offer("g", [(u, dense[4096 * i: 4096 * (i + 1)], None) for i, u in enumerate(units["g"])],
                          area, 4 * 4096)
        s.commit(v)
        deltas = [[*e[:5], e[5] ^ (1 if e[0] in bad else 0), e[6]] for e in entries if e is not None]
        ready = SimpleNamespace(group="g", version=v, chunks=[[i, 4096 * i, 4096, -1] for i in range(4)],
                                deltas=deltas)
        reads.clear()
        held.begin()
        read_held(held, 0, ready, [(i, c[i], 4096 * i, 4096, -1, None) for i in range(4)], fetch=fetch,
                  verify=lambda *a, **k: None, where="t")
        held.commit(v)
        return dict(held.counts)

    g = torch.Generator().manual_seed(0)
    dense.copy_(torch.randint(0, 256, (4 * 4096,), dtype=torch.uint8, generator=g))
    assert sync(1)["delta_dense_chunks"] == 4
    dense[torch.randint(0, 4 * 4096, (40,), generator=g)] ^= 1
    got = sync(2)
    assert got["delta_chunks"] == 4 and got["delta_heals"] == 0 and torch.equal(held.arena[: 4 * 4096], dense)
    assert [r[2] for r in reads] == [True]  # four payloads side by side: one read
    dense[torch.randint(0, 4 * 4096, (40,), generator=g)] ^= 1
    got = sync(3, bad={1})  # chunk 1's checksum does not match: it alone is read dense
    assert got["delta_chunks"] == 3 and got["delta_heals"] == 1 and got["delta_dense_chunks"] == 1, got
    assert torch.equal(held.arena[: 4 * 4096], dense) and [r[1] for r in reads if not r[2]] == [4096]


def test_a_delta_offer_that_cannot_be_read_heals_to_dense_not_a_lost_producer() -> None:
    """An entry whose payload offset lies past the producer's buffer: the payload read fails, and the chunk is read
    dense in the same sync (``delta_heals``) — the producer is not reported lost, the version does not fail."""
    from shardsync.engine.consumer.chunksinks import HeldSink
    from shardsync.errors import TransportError

    lay = _layout()
    buf = torch.arange(5096, dtype=torch.int64).to(torch.uint8)  # the producer's buffer: the dense bytes at 0

    class Transport:
        def read(self, p, off, n, dst, *, timeout_s):
            if off + n > buf.numel():
                raise TransportError(f"read [{off}, {off + n}) past the {buf.numel()}-byte buffer")
            dst.copy_(buf[off: off + n])

    lost: list = []
    ctx = SimpleNamespace(id="c0", transport=Transport(), lease_s=5.0, layouts={"g": lay},
                          lost=lambda *a: lost.append(a) or RuntimeError("lost"))
    held = HeldChunks({"g": lay}, device=torch.device("cpu"))
    held.begin()
    held.touch("g", 0)
    held.commit(7)  # chunk 0 held at version 7: an offer against it is taken
    held.begin()
    ready = SimpleNamespace(group="g", version=8, chunks=[[0, 0, 4096, -1]], deltas=[[0, 1 << 40, 1, 3, 7, 99, 0]])
    check = SimpleNamespace(announced=lambda r: iter([(0, lay.chunks[0], 0, 4096, -1, None)]),
                            verify=lambda *a, **k: None)
    got = HeldSink(ctx, 0, 8, held).read(ready, check)
    assert not lost and held.counts["delta_heals"] == 1 and held.counts["delta_dense_chunks"] == 1, held.counts
    assert torch.equal(held.view("g", 0), buf[:4096]) and got >= 4096


def test_a_host_history_beside_a_ring_keeps_its_bases_in_host_memory_and_encodes_the_same() -> None:
    """``ProducerConfig.delta_host_history``: the bases live in (pinned, where CUDA is) host memory whatever the
    ring's device; offers are the same entries as with the history beside the ring."""
    from shardsync.delta.sender import DeltaSender

    lay = _layout()
    units = {"g": [SimpleNamespace(digest="d", chunk=c) for c in lay.chunks]}
    here, host = (DeltaSender(units, device=torch.device("cpu"), budget_bytes=None, host=h) for h in (False, True))
    entries = []
    for s in (here, host):
        region, area = torch.zeros(4096, dtype=torch.uint8), torch.zeros(1024, dtype=torch.uint8)
        s.begin(1)
        s.offer("g", [(units["g"][0], region, None)], area, 8192)[0]
        s.commit(1)
        s.begin(2)
        region[100] = 3
        entries.append(s.offer("g", [(units["g"][0], region, None)], area, 8192)[0])
        s.commit(2)
    assert entries[0] == entries[1] and entries[0] is not None
    assert host.history.device.type == "cpu" and host.stats()["delta_history_device"].startswith("cpu")
    assert host.history.pinned == torch.cuda.is_available()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 200)), max_size=30), st.integers(1, 2048))
def test_the_consumers_payload_batches_fit_their_staging_and_keep_every_delta_once(raw, room) -> None:
    """``receiver._batches`` on whatever offsets and sizes a producer announces (payloads side by side, apart, out of
    order, overlapping): every delta comes out once and in order, each batch's runs fit the staging buffer without
    overlapping, a run's deltas lie side by side at the producer in increasing order, and each run starts aligned."""
    from shardsync.delta.receiver import _batches, _Delta
    from shardsync.plan.pack import ALIGN

    deltas = [_Delta((i,), 0, None, off, None, min(size, room)) for i, (off, size) in enumerate(raw)]
    seen = []
    for runs in _batches(deltas, room):
        used = []
        for off, at, ds in runs:
            assert at % ALIGN == 0 and ds[0].offset == off
            span = ds[-1].offset + ds[-1].size - off
            assert at + span <= room
            for a, b in zip(ds, ds[1:]):
                assert 0 <= b.offset - (a.offset + a.size) < ALIGN
            used.append((at, at + span))
            seen += [d.row[0] for d in ds]
        used.sort()
        assert all(a[1] <= b[0] for a, b in zip(used, used[1:]))
    assert seen == list(range(len(deltas)))
