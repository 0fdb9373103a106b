"""The pure halves of the trainer-side schedule: the lockstep plan (engine/schedule.py) and the consumer's
receive slots (engine/consumer/recvslots.py), including the property that makes parallel pulls deadlock-free."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsync.engine.consumer.recvslots import RecvSlots
from shardsync.engine.schedule import lockstep
from shardsync.errors import MetadataMismatch, TransportError
from shardsync.plan.groups import group_order
from shardsync.source import gather_groups

NAMES = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a",
         "model.layers.1.b", "model.norm.weight", "lm_head.weight"]
BYTES = {n: 10 * (i + 1) for i, n in enumerate(NAMES)}


def test_every_batch_is_iterated_and_only_routed_tensors_are_kept() -> None:
    batches = gather_groups(NAMES)
    ls = lockstep(batches, needs={"model.layers.1": {"model.layers.1.b"}}, held=None, nbytes=BYTES)
    assert ls.batches == batches and len(ls.batches) == 4          # rule 1: nothing routed, still iterated
    assert ls.keep == [frozenset(), frozenset(), frozenset({"model.layers.1.b"}), frozenset()]
    assert ls.pack_after == [[], [], ["model.layers.1"], []] and ls.order == ["model.layers.1"]
    assert ls.drop_after[2] == ["model.layers.1.b"]
    assert ls.peak_bytes == max(ls.batch_bytes)                     # nothing carried across batches


def test_a_tied_embedding_is_carried_to_post_and_counted_in_the_peak() -> None:
    batches = gather_groups(NAMES)
    needs = {"pre": {"model.embed_tokens.weight"}, "post": {"model.embed_tokens.weight", "model.norm.weight"}}
    ls = lockstep(batches, needs=needs, held=None, nbytes=BYTES)
    assert ls.pack_after[0] == ["pre"] and ls.pack_after[3] == ["post"]
    assert ls.drop_after[0] == [] and "model.embed_tokens.weight" in ls.drop_after[3]
    assert ls.peak_bytes == ls.batch_bytes[3] + BYTES["model.embed_tokens.weight"]


def test_groups_are_packed_in_transfer_order_even_when_the_source_yields_otherwise() -> None:
    batches = [["model.layers.1.a"], ["model.layers.0.a"], ["model.norm.weight"]]  # layer 1 comes first
    needs = {"model.layers.0": {"model.layers.0.a"}, "model.layers.1": {"model.layers.1.a"}}
    ls = lockstep(batches, needs=needs, held=None, nbytes=BYTES)
    assert ls.order == ["model.layers.0", "model.layers.1"]
    assert ls.pack_after == [[], ["model.layers.0", "model.layers.1"], []]     # layer 1 waits for layer 0
    assert ls.peak_bytes == BYTES["model.layers.0.a"] + BYTES["model.layers.1.a"]


def test_held_names_bound_what_a_batch_materialises() -> None:
    ls = lockstep(gather_groups(NAMES), needs={}, held={"model.layers.0.a"}, nbytes=BYTES)
    assert ls.batch_bytes == [0, BYTES["model.layers.0.a"], 0, 0]


def test_a_routed_name_the_source_never_yields_is_refused_naming_it() -> None:
    with pytest.raises(MetadataMismatch, match="model.layers.7.x"):
        lockstep(gather_groups(NAMES), needs={"model.layers.7": {"model.layers.7.x"}}, held=None, nbytes=BYTES,
                 rank=3)
    with pytest.raises(MetadataMismatch, match="two gather groups"):
        lockstep([["a"], ["a"]], needs={}, held=None, nbytes={"a": 1})


def test_receive_slots_need_two_and_the_head_takes_the_last() -> None:
    with pytest.raises(ValueError):
        RecvSlots(1, ["g0"])
    s = RecvSlots(2, ["g0", "g1", "g2"])
    assert s.acquire("g2", timeout_s=1, what="g2") == 0                 # two free: any group
    with pytest.raises(TransportError, match="no receive slot"):
        s.acquire("g1", timeout_s=0.2, what="g1")                       # last slot: g1 is not the head
    assert s.acquire("g0", timeout_s=1, what="g0") == 1                 # g0 is the head
    assert s.acquire("g0", timeout_s=1, what="g0") == 1                 # a second producer's part: same slot
    s.release("g0")
    assert s.max_in_use == 2


@settings(max_examples=40, deadline=None)
@given(n_groups=st.integers(2, 12), n_prod=st.integers(1, 4), slots=st.integers(2, 4), seed=st.integers(0, 10**6))
def test_parallel_pullers_with_any_routing_always_finish(n_groups: int, n_prod: int, slots: int, seed: int) -> None:
    """Each group is served by a random non-empty set of producers; one thread per producer walks its groups in
    transfer order (as producers pack them), acquiring the group's slot; a group is applied (slot freed) when all
    its producers delivered. With the head rule this never deadlocks, whatever the routing and timing."""
    rng = random.Random(seed)
    order = group_order([f"model.layers.{i}" for i in range(n_groups)])
    serve = {g: set(rng.sample(range(n_prod), rng.randint(1, n_prod))) for g in order}
    pool = RecvSlots(slots, order)
    missing = {g: set(ps) for g, ps in serve.items()}
    lock, errors = threading.Lock(), []

    def puller(p: int) -> None:
        try:
            for g in [g for g in order if p in serve[g]]:
                pool.acquire(g, timeout_s=5, what=g)
                with lock:
                    missing[g].discard(p)
                    done = not missing[g]
                if done:
                    pool.release(g)
        except Exception as e:  # a deadlock shows up as a timeout here
            errors.append(e)

    ts = [threading.Thread(target=puller, args=(p,)) for p in range(n_prod)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=30)
    assert not errors and all(not m for m in missing.values())
    assert pool.max_in_use <= slots
