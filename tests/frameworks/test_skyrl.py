"""SkyRL's weight-sync entry points driving the ``shardsync`` strategy over Ray on CPU (skyrl-train 0.3.1).

What runs unchanged from SkyRL: ``skyrl_train.weight_sync`` (the strategy interface, ``WeightChunk``,
``WeightUpdateRequest``; ``get_transfer_strategy_cls`` picks the strategy by ``generator.weight_sync_backend`` once
``shardsync.enable_skyrl()`` ran in the driver, in every Ray worker through Ray's setup hook), the trainer
``Worker``'s constructor and ``init_weight_sync_state``, ``InferenceEngineClient`` and ``RayWrappedInferenceEngine``
over Ray, and SkyRL's default config (``ppo_base_config.yaml``). What stands in, and why: ``skyrl_workers``' docstring
(the FSDP worker module imports CUDA-only ``flash_attn``; SkyRL's vLLM engine targets vLLM 0.11). Two trainer
ranks serve two engines, three updates; every tensor an engine receives equals the trainer's byte for byte, and
both trainer ranks serve a share. An engine killed between updates does not fail the others' updates.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import ray
import torch
from omegaconf import OmegaConf

import shardsync.integrations.skyrl as skyrl
from shardsync.integrations.skyrl import select

pytestmark = [pytest.mark.timeout(420), pytest.mark.ray]
HERE = Path(__file__).resolve().parent


def _cfg(engines: int):
    import skyrl_train.config

    cfg = OmegaConf.load(Path(skyrl_train.config.__file__).parent / "ppo_base_config.yaml")
    cfg.generator.weight_sync_backend = "shardsync"
    cfg.generator.num_inference_engines = engines
    cfg.generator.inference_engine_tensor_parallel_size = 1
    cfg.generator.shardsync = {"timeout_s": 30, "init_timeout_s": 60, "lease_s": 3}
    return cfg


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(monkeypatch):
    for name in (select.HOOK_ENV, select.NEXT_HOOK_ENV):
        monkeypatch.delenv(name, raising=False)
    skyrl.enable_skyrl()  # before ray.init: every Ray worker selects the strategy by name
    pythonpath = os.pathsep.join([str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    ray.init(num_cpus=6, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        yield
    finally:
        ray.shutdown()


def _start(engines: int):
    from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient
    from skyrl_train.inference_engines.ray_wrapped_inference_engine import RayWrappedInferenceEngine
    from skyrl_workers import Engine, Trainer

    cfg = _cfg(engines)
    port = _port()
    trainers = [ray.remote(Trainer).remote(cfg, 2, r, "127.0.0.1", port) for r in range(2)]
    actors = [ray.remote(Engine).remote() for _ in range(engines)]
    client = InferenceEngineClient([RayWrappedInferenceEngine(a) for a in actors], None, cfg)
    chosen = ray.get([t.init_model.remote() for t in trainers], timeout=120)
    assert all(c.endswith(":ShardsyncTransferStrategy") for c in chosen), chosen
    ray.get([t.init_weight_sync_state.remote(client) for t in trainers], timeout=120)
    return trainers, actors, client


def _update(trainers, client, step: int) -> list[dict]:
    ray.get([t.set_step.remote(step) for t in trainers], timeout=60)
    ray.get([t.broadcast_to_inference_engines.remote(client) for t in trainers], timeout=180)
    return ray.get([t.sender_stats.remote() for t in trainers], timeout=30)


def _exact(actor, step: int) -> None:
    from skyrl_workers import weights_at

    updates, got = ray.get(actor.got.remote(), timeout=30)
    expected = weights_at(step)
    assert sorted(got) == sorted(expected)
    for n, t in expected.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(got[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), n


def test_skyrl_weight_sync_entry_points_drive_shardsync_bit_exact(cluster):
    trainers, actors, client = _start(engines=2)
    for step in (1, 2, 3):
        stats = _update(trainers, client, step)
        for a in actors:
            _exact(a, step)
        assert [s["version"] for s in stats] == [step, step], stats
        assert all(s["bytes_sent"] > 0 for s in stats), stats  # both trainer ranks served a share
        assert stats[0]["engine_errors"] == [], stats[0]
    assert ray.get([a.got.remote() for a in actors])[0][0] == 3


def test_a_dead_engine_does_not_fail_the_others_update(cluster):
    trainers, actors, client = _start(engines=2)
    _update(trainers, client, 1)
    ray.kill(actors[1])
    for step in (2, 3):
        stats = _update(trainers, client, step)
        _exact(actors[0], step)
        assert [s["version"] for s in stats] == [step, step], stats
    assert stats[0]["engine_errors"], stats[0]  # the dead engine's failure is reported, not raised
