"""The verl checkpoint-engine backend ``"shardsync"`` against verl's own interface (verl 0.9.1, installed).

1. In-process: trainer and rollout engines driven through verl's lifecycle exactly as verl's
   ``CheckpointEngineManager`` drives them (prepare -> build_topology -> init_process_group -> send/receive ->
   finalize, every update), 2 trainer ranks -> 2 rollout workers, 3 updates with changed weights, bit-exact.
2. Typed errors: a renamed or reshaped tensor names the tensor and the rank; an absent trainer is a timeout
   that says what was waited for (no hang).
3. verl's harness (``tests/checkpoint_engine/test_utils.py`` of the verl wheel, over Ray): see
   ``test_verl_harness.py``.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch
from verl.checkpoint_engine import CheckpointEngineRegistry

import shardsync.integrations.verl  # noqa: F401  (registers "shardsync")
from shardsync.errors import MetadataMismatch, SyncError, TransportError
from shardsync.sources.stream import owners
from shardsync.types import ParamMeta

pytestmark = pytest.mark.timeout(120)


def model_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    shapes = {"model.embed_tokens.weight": (64, 16)}
    for i in range(3):
        shapes |= {f"model.layers.{i}.self_attn.qkv_proj.weight": (48, 16), f"model.layers.{i}.mlp.down_proj.weight": (16, 40),
                   f"model.layers.{i}.input_layernorm.weight": (16,)}
    shapes |= {"model.norm.weight": (16,), "lm_head.weight": (64, 16)}
    out = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    out["model.layers.1.mlp.down_proj.weight"] = out["model.layers.1.mlp.down_proj.weight"].float()  # mixed dtypes
    return out


def engines(n_trainers: int, n_rollout: int, **kw):
    new = lambda **k: CheckpointEngineRegistry.new("shardsync", bucket_size=4096, host="127.0.0.1", **kw, **k)
    return [new(is_master=(r == 0)) for r in range(n_trainers)], [new() for _ in range(n_rollout)]


def topology(trainers, rollouts):
    """What verl's CheckpointEngineManager.build_process_group does."""
    meta = [e.prepare() for e in trainers + rollouts]
    tkw, rkw = type(trainers[0]).build_topology(len(trainers), len(rollouts), meta)
    for i, e in enumerate(trainers):
        e.init_process_group(**{k: v[i] for k, v in tkw.items()})
    for i, e in enumerate(rollouts):
        e.init_process_group(**{k: v[i] for k, v in rkw.items()})


async def update(trainers, rollouts, sends):
    """One CheckpointEngineManager.update_weights: every send and receive at once, then finalize."""
    async def recv(e):
        return {n: t.clone() async for n, t in e.receive_weights()}
    res = await asyncio.gather(*[e.send_weights(iter(s)) for e, s in zip(trainers, sends)],
                               *[recv(e) for e in rollouts], return_exceptions=True)
    for e in trainers + rollouts:
        e.finalize()
    return res[:len(trainers)], res[len(trainers):]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                    b.view(-1).view(torch.uint8))


def close(*groups):
    for g in groups:
        for e in g:
            e.close()


def test_two_trainers_two_rollouts_three_updates_bit_exact():
    trainers, rollouts = engines(2, 2)
    try:
        for step in (1, 2, 3):
            topology(trainers, rollouts)
            state = model_state(step)
            sent, got = asyncio.run(update(trainers, rollouts, [list(state.items())] * 2))
            assert all(not isinstance(x, BaseException) for x in sent + got), sent + got
            for received in got:
                assert sorted(received) == sorted(state) and len(received) == len(state)  # groups land in any order
                assert all(same_bytes(received[n], t) for n, t in state.items())
        # each tensor served by exactly one trainer rank, split about evenly by bytes
        bytes_sent = [e.stats["bytes_sent"] for e in trainers]
        assert all(b > 0 for b in bytes_sent) and max(bytes_sent) < 2 * min(bytes_sent)
        assert trainers[0].source.held_names().isdisjoint(trainers[1].source.held_names())
    finally:
        close(rollouts, trainers)


def test_owners_split_every_tensor_once_balanced():
    metas = [ParamMeta(name=f"t{i}", dtype="float32", shape=(10 + i,)) for i in range(20)]
    own = owners(metas, 3)
    assert set(own) == {m.name for m in metas} and set(own.values()) == {0, 1, 2}
    load = [sum(m.nbytes for m in metas if own[m.name] == r) for r in range(3)]
    assert max(load) - min(load) <= max(m.nbytes for m in metas)


@pytest.mark.parametrize("bad", ["rename", "reshape"])
def test_bad_tensor_is_a_typed_error_naming_it_and_the_rank(bad):
    trainers, rollouts = engines(1, 1, timeout_s=10)
    try:
        topology(trainers, rollouts)
        sent, got = asyncio.run(update(trainers, rollouts, [list(model_state(1).items())]))
        assert not isinstance(sent[0], BaseException) and not isinstance(got[0], BaseException)
        state = model_state(2)
        name = "model.layers.1.self_attn.qkv_proj.weight"
        if bad == "rename":
            state = {("model.layers.1.self_attn.q_proj.weight" if n == name else n): t for n, t in state.items()}
        else:
            state[name] = state[name][:40]
        topology(trainers, rollouts)
        t0 = time.monotonic()
        sent, got = asyncio.run(update(trainers, rollouts, [list(state.items())]))
        assert isinstance(sent[0], MetadataMismatch), sent
        wanted = "q_proj" if bad == "rename" else name
        assert wanted in str(sent[0]) and re.search(r"(trainer|producer) rank 0", str(sent[0]))
        assert isinstance(got[0], SyncError) or isinstance(got[0], TransportError), got  # told, not hung
        assert time.monotonic() - t0 < 30
    finally:
        close(rollouts, trainers)


def test_absent_trainer_times_out_with_what_it_waited_for():
    trainers, rollouts = engines(1, 1, timeout_s=1.0, init_timeout_s=1.5)
    try:
        topology(trainers, rollouts)  # the trainer never sends

        async def recv():
            return [n async for n, _ in rollouts[0].receive_weights()]
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"rollout worker 0: waited 1.5 s for trainer rank 0 .* newer than 0"):
            asyncio.run(recv())
        assert time.monotonic() - t0 < 10
    finally:
        close(rollouts, trainers)


def test_wrong_role_and_missing_topology_are_refused():
    trainers, rollouts = engines(1, 1)
    try:
        with pytest.raises(SyncError, match="before init_process_group"):
            asyncio.run(trainers[0].send_weights(iter([])))
        topology(trainers, rollouts)
        with pytest.raises(MetadataMismatch, match="is a rollout"):
            asyncio.run(rollouts[0].send_weights(iter([])))
        with pytest.raises(SyncError, match="exactly one trainer rank with is_master"):
            type(trainers[0]).build_topology(2, 1, [{}, {}, {}])
    finally:
        close(rollouts, trainers)
