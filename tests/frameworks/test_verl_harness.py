"""verl's checkpoint-engine harness (verl 0.9.1 wheel: ``verl.checkpoint_engine.CheckpointEngineManager`` and
``tests/checkpoint_engine/test_utils.py``) driving the ``"shardsync"`` backend over Ray on CPU: 2 trainer
workers -> 2 rollout replicas, 3 updates, the backend chosen by verl's config (``backend`` +
``custom_backend_module``) and loaded by verl's own import hooks in every process.

What runs unchanged from verl: the manager (abort/prepare/build_topology/init_process_group/update/finalize
over Ray, every update), ``create_rollout_worker_group``, ``CheckpointEngineWorker`` with the harness's
``MockServerAdapter`` and its ``check_weights`` (against the checkpoint on disk, step 1). What stands in: the
trainer worker (``verl_workers.StateTrainer``) — verl's ``TrainingWorkerTest`` builds an FSDP engine whose
``initialize_global_process_group_ray`` asks for ``cpu:gloo,cpu:nccl`` (verl 0.9.1 has no CPU platform; it
falls back to "nvidia") and fails on this CPU-only torch: "Distributed package doesn't have NCCL built in".
Steps 2 and 3 change the weights; every received tensor is compared byte for byte.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import ray
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.checkpoint_engine import CheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

from tests.checkpoint_engine.test_utils import MockReplica

pytestmark = [pytest.mark.timeout(300), pytest.mark.ray]
HERE = Path(__file__).resolve().parent


def tiny_checkpoint(path: Path) -> str:
    cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def test_verl_manager_drives_shardsync_backend_bit_exact(tmp_path):
    import verl_workers  # noqa: F401  (also imported by the workers, through PYTHONPATH)
    from verl_workers import RecordingRollout, StateTrainer, weights_at

    model_path = tiny_checkpoint(tmp_path / "model")
    pythonpath = os.pathsep.join([str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        ce = CheckpointEngineConfig(backend="shardsync", update_weights_bucket_megabytes=1,
                                    custom_backend_module="shardsync.integrations.verl",
                                    engine_kwargs={"shardsync": {"timeout_s": 60, "init_timeout_s": 120}})
        model_config = HFModelConfig(path=model_path, load_tokenizer=False)
        rollout_config = RolloutConfig(name="vllm", checkpoint_engine=ce)
        pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
        trainer_pool, rollout_pool = split_resource_pool(pool, [2, 2])
        actor_wg = RayWorkerGroup(resource_pool=trainer_pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(StateTrainer), model_path=model_path, checkpoint_engine_config=ce))
        rollout = RayWorkerGroup(resource_pool=rollout_pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(RecordingRollout), model_config=model_config, rollout_config=rollout_config))
        replicas = [MockReplica(replica_rank=r, config=rollout_config, model_config=model_config) for r in range(2)]

        async def run() -> None:
            await asyncio.gather(*[r.init_hybrid(rollout) for r in replicas])
            manager = CheckpointEngineManager(config=ce, actor_wg=actor_wg, replicas=replicas)
            for step in (1, 2, 3):
                actor_wg.set_step(step)
                await manager.update_weights(global_steps=step)
                expected = weights_at(model_path, step)
                for got in rollout.received():
                    assert sorted(got) == sorted(expected)
                    for n, t in expected.items():
                        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
                        assert torch.equal(got[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), n
                if step == 1:
                    rollout.check_weights()  # the harness's own check against the checkpoint on disk
            sent = actor_wg.sent_bytes()
            assert all(b > 0 for b in sent), sent  # both trainer ranks served a share

        asyncio.run(run())
    finally:
        ray.shutdown()
