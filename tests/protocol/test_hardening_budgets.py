"""Hardening III, budgets: a token holder cannot grow a producer's ring or gather peak past what one group of
every plan really needs, and the ring shrinks again when such plans go.

Real sockets: two producers and a zoo consumer as threads of this process (the ``pair`` of
``test_wire_hardening.py``); the attacker is a second control connection with the group's token.
"""

from __future__ import annotations

import pytest

from shardsync.engine.protocol import messages as m
from shardsync.engine.protocol.control import ControlClient
from shardsync.errors import ConsumerDropped, PlanError
from shardsync.testing.harness.attacks import forged_plan

from test_wire_hardening import TOKEN, _sync2, pair  # noqa: F401  (the fixture)


def _register(c: ControlClient, cid: str, forge: str, times: int = 1) -> str:
    w = c.call(m.Hello(consumer=cid), timeout_s=10)
    plan = forged_plan(w.metadata, cid, forge, times=times)
    c.call(m.RegisterPlan(consumer=cid, session=w.session, plan=plan.to_json()), timeout_s=10)
    return w.session


def test_a_plan_piling_copies_into_one_group_is_refused_naming_the_group(pair) -> None:  # noqa: F811
    """60 copies of every tensor, each in its group (the ring slot is one group of every plan): refused at
    registration with the consumer, the group and the bound named; so are four distinct 16/15/14/13× plans that
    the routed-bytes budget alone let through. The honest consumer's next sync is exact and the ring unchanged."""
    p0, p1, z = pair
    ring = p0.stats["ring_bytes"], p1.stats["ring_bytes"]
    c = ControlClient(p0.address, TOKEN, peer="coordinator")
    try:
        for i, times in enumerate((60, 16, 15, 14, 13)):
            with pytest.raises(PlanError, match=rf"consumer 'evil{i}'.*in group '.*over the bound .*max_group_bytes"):
                _register(c, f"evil{i}", "amplify", times)
    finally:
        c.close()
    _sync2(p0, p1, [z], max(p1.versions) + 1)
    assert (p0.stats["ring_bytes"], p1.stats["ring_bytes"]) == ring


def test_a_plan_gathering_the_whole_model_at_once_is_refused(pair) -> None:  # noqa: F811
    """Every tensor read into one group: each producer would gather the whole model at once. With the bound at
    twice the largest group it is refused, naming what the group's sources weigh."""
    p0, p1, z = pair
    co = p0.coordinator
    bound = co.max_group_bytes
    co.max_group_bytes = bound // 2  # four times the largest group is more than this tiny model: two times is not
    c = ControlClient(p0.address, TOKEN, peer="coordinator")
    try:
        with pytest.raises(PlanError, match=r"would gather sources of \d+ bytes in group 'pre'"):
            _register(c, "gatherer", "one_group")
    finally:
        co.max_group_bytes = bound
        c.close()
    _sync2(p0, p1, [z], max(p1.versions) + 1)


def test_the_ring_grows_for_an_accepted_plan_and_shrinks_when_it_leaves(pair) -> None:  # noqa: F811
    """A plan within the bound that needs bigger slots grows the rings at the next version; once it is gone (its
    lease lapsed: it sends no heartbeat) the version after prunes it and the rings shrink back to what the honest consumer needs (a new descriptor,
    which the consumer picks up): every sync exact."""
    p0, p1, z = pair
    c = ControlClient(p0.address, TOKEN, peer="coordinator")
    before = p0.stats["ring_bytes"]
    session = _register(c, "big", "amplify", times=3)
    try:
        v = max(p1.versions) + 1
        _sync2(p0, p1, [z], v, may_drop=frozenset({"big"}))  # routed: its groups are packed (it never pulls)
        grown = p0.stats["ring_bytes"]
        with pytest.raises(ConsumerDropped):  # its lease lapsed in that version: already gone
            c.call(m.Goodbye(consumer="big", session=session), timeout_s=10)
        _sync2(p0, p1, [z], v + 1)  # "big" left: pruned at this version, the epoch moves
        _sync2(p0, p1, [z], v + 2)
    finally:
        c.close()
    assert grown >= 2 * before and p0.stats["ring_bytes"] == before, (before, grown, p0.stats["ring_bytes"])


def test_a_plan_of_a_hundred_thousand_one_element_scatters_is_refused_by_its_count(pair) -> None:  # noqa: F811
    """Few bytes, much work: 100,000 one-element scatters are refused on their count before any per-scatter check
    (naming the count and the bound); the honest consumer's next sync is exact."""
    from shardsync.plan.checks import max_scatters

    p0, p1, z = pair
    c = ControlClient(p0.address, TOKEN, peer="coordinator")
    try:
        assert max_scatters(len(p0.coordinator.metadata)) < 100_000
        with pytest.raises(PlanError, match=r"plan has 100000 scatters, more than \d+"):
            _register(c, "scatterer", "many_scatters", times=100_000)
    finally:
        c.close()
    _sync2(p0, p1, [z], max(p1.versions) + 1)
