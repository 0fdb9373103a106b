"""One round trip for many announced groups: ``WaitReady(more=n)`` is answered with every group already announced
for the consumer (each the next after the one before, as asking one at a time with ``after`` would give), bounded in
count and bytes, and the consumer refuses an answer that does not keep to what it asked."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from shardsync.engine.producer.versions import READIES_BYTES, VersionState, VersionTable
from shardsync.engine.protocol import messages as m

GROUPS = [f"model.layers.{i}" for i in range(5)]


def _table(sources: bytes = b"") -> VersionTable:
    t = VersionTable(SimpleNamespace(rank=0, lease_s=0.4, timeout_s=10.0, straggler_s=None),
                     lease_view=lambda: {"dead": {}, "left": {}, "dead_producers": {}, "failed": {}},
                     on_stragglers=lambda v, dropped: None)
    st = t.versions[3] = VersionState(members={"c": ("d", "s")})
    for g in GROUPS:
        st.pending[g] = {"c"}
        t.announce(st, g, {"d": m.Ready(version=3, group=g, chunks=[[0, -1, 8, -1]], sources=sources)})
    return t


def _ask(t: VersionTable, more: int, after: str = "") -> list[str]:
    got = t.wait_ready(m.WaitReady(consumer="c", session="s", version=3, group="", after=after, more=more))
    if isinstance(got, m.Pending):
        return []
    return [r.group for r in (got.readies if isinstance(got, m.Readies) else [got])]


def test_one_answer_carries_every_group_announced_after_the_one_asked_for() -> None:
    t = _table()
    assert _ask(t, 0) == GROUPS[:1]  # a plain WaitReady: one Ready, as before
    assert isinstance(t.wait_ready(m.WaitReady(consumer="c", session="s", version=3, group="", more=2)), m.Readies)
    assert _ask(t, 2) == GROUPS[:3]
    assert _ask(t, 63) == GROUPS
    assert _ask(t, 63, after=GROUPS[1]) == GROUPS[2:]
    assert _ask(t, 63, after=GROUPS[-1]) == []  # nothing more announced: Pending after the short poll
    t.versions[3].pending[GROUPS[1]].discard("c")  # released groups are never offered again
    assert _ask(t, 63) == [GROUPS[0], *GROUPS[2:]]
    named = t.wait_ready(m.WaitReady(consumer="c", session="s", version=3, group=GROUPS[3], more=9))
    assert isinstance(named, m.Ready) and named.group == GROUPS[3]  # a named group is answered alone


def test_an_answer_stays_within_its_byte_bound_and_the_first_group_always_comes() -> None:
    big = b"x" * (READIES_BYTES // 2)
    t = _table(sources=big)
    assert _ask(t, 63) == GROUPS[:1]  # a second would pass the bound: it waits for the next ask
    assert _ask(t, 63, after=GROUPS[0]) == GROUPS[1:2]


def test_the_schema_bounds_how_many_groups_are_asked_for_and_answered() -> None:
    r = m.Ready(version=1, group="g", chunks=[])
    assert isinstance(m.decode(m.encode(m.Readies(readies=[r, r]))), m.Readies)
    for bad in (m.Readies(readies=[r]), m.Readies(readies=[r] * (m.MAX_MORE + 2)),
                m.WaitReady(consumer="c", session="s", version=1, group="", more=m.MAX_MORE + 1),
                m.WaitReady(consumer="c", session="s", version=1, group="", more=-1)):
        with pytest.raises(msgspec.ValidationError):
            m.decode(m.encode(bad))


def _puller(answer: m.Msg):
    """A puller of producer 0 whose producer gives ``answer`` to every WaitReady (a fault-injecting stand-in)."""
    import threading

    from shardsync.engine.consumer.puller import Puller

    asked: list[m.WaitReady] = []
    client = SimpleNamespace(call=lambda msg, timeout_s: asked.append(msg) or answer)
    stub = SimpleNamespace(
        ctx=SimpleNamespace(id="c", timeout_s=5.0, lease_s=1.0, clients={0: client}),
        rnd=SimpleNamespace(version=3, session="s", failing=threading.Event(), routes={g: [0] for g in GROUPS}),
        p=0, todo=list(GROUPS), sources=True, sink=SimpleNamespace(takes_deltas=False), check_peers=lambda: None)
    stub.checked = Puller.checked.__get__(stub)
    return (lambda **kw: Puller.wait_readies(stub, **kw)), asked


def test_the_consumer_asks_for_what_is_left_and_refuses_answers_beyond_it() -> None:
    from shardsync.errors import SyncError

    rs = [m.Ready(version=3, group=g, chunks=[[0, -1, 8, -1]]) for g in GROUPS]
    ask, asked = _puller(m.Readies(readies=rs[:3]))
    seen: set[str] = set()
    assert [r.group for r in ask(left=5, seen=seen)] == GROUPS[:3] and seen == set(GROUPS[:3])
    assert asked[-1].more == 4 and asked[-1].group == ""
    with pytest.raises(SyncError, match="offered group 'model.layers.0' of version 3 twice"):
        ask(left=5, seen=seen)  # the same groups again in this round
    with pytest.raises(SyncError, match="answered 3 groups, asked for at most 2"):
        ask(left=2)
    ask, _ = _puller(m.Readies(readies=[rs[0], m.Ready(version=3, group="model.layers.9", chunks=[])]))
    with pytest.raises(SyncError, match="offered group 'model.layers.9'"):  # not on this consumer's routes
        ask(left=5)
