"""The lockstep loop's per-batch cache (``engine/producer/same_batches.py``, issue 26): a source that yields the same tensor
objects every sync has each gather batch checked once; a replaced tensor is noticed and checked in full again."""

from __future__ import annotations

import pytest
import torch

from shardsync.engine.producer.same_batches import SameBatches
from shardsync.errors import MetadataMismatch
from shardsync.source import ModuleSource
from shardsync.testing.zoo import hf_state_dict

from test_wire import CFG, _close, _producer, _start, _sync, _Zoo
import test_wire


def test_a_batch_of_the_same_objects_hits_and_any_other_misses() -> None:
    a, b, c = torch.zeros(4), torch.ones(2, 3), torch.zeros(3)
    same = SameBatches()
    assert same.check(0, [a, None, b]) is None  # nothing recorded yet
    same.record(0, [a, None, b], 32, [0, 2], ["a", "b"])
    assert same.check(0, [a, None, b]) == (32, [0, 2], ["a", "b"])
    assert same.check(0, [a, None, c]) is None  # another object: the entry is gone until recorded again
    assert same.check(0, [a, None, b]) is None
    same.record(0, [a, None, b], 32, [0, 2], ["a", "b"])
    b.data = torch.ones(2, 3)  # the same object, new storage
    assert same.check(0, [a, None, b]) is None
    same.record(0, [a, None, b], 32, [0, 2], ["a", "b"])
    assert same.check(0, [a, b, None]) is None and same.check(1, [a, None, b]) is None
    assert same.hits == 1


class _InPlace(ModuleSource):
    """A trainer that updates its weights in place (the same objects every version)."""

    def at(self, v: int) -> None:
        with torch.no_grad():
            for n, t in hf_state_dict(CFG, seed=v).items():
                self._state[n].copy_(t)


def test_the_producer_checks_each_batch_once_for_the_same_objects_and_again_after_a_swap(monkeypatch) -> None:
    monkeypatch.setattr(test_wire, "_Source", _InPlace)
    p, th, err = _producer(1)
    z = _Zoo(p.address, "r0/tp0")
    try:
        _start([z])
        th.join(30)
        assert not err, err
        batches = p.stats["gather_batches"]
        reused = []
        for v in (1, 2, 3):
            stats, errs = _sync(p, [z], v)
            assert not errs and z.exact(v), errs
            reused.append(stats["batches_reused"])
        assert reused == [0, batches, batches]  # checked in full once, then only their identity
        name = "model.layers.0.self_attn.q_proj.weight"
        old = p.source._state[name]
        p.source._state[name] = old.clone()  # a new object with the same bytes: that batch is checked in full again
        stats, errs = _sync(p, [z], 4)
        assert not errs and z.exact(4) and stats["batches_reused"] == batches - 1, (errs, stats["batches_reused"])
        p.source._state[name] = torch.zeros(3, 5, dtype=old.dtype)  # a wrong shape: the full check names it
        p.source.at = lambda v: None
        with pytest.raises(MetadataMismatch, match="q_proj"):
            _sync(p, [z], 5)
    finally:
        _close(p, [z])
