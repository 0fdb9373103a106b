"""Ray worker classes for ``test_verl_harness.py`` (imported by the Ray workers: the test puts this folder on
their PYTHONPATH).

- ``StateTrainer`` stands in for verl's ``TrainingWorkerTest`` (``tests/checkpoint_engine/test_utils.py``),
  whose FSDP engine cannot start on a CPU-only torch (see the test's docstring): the same two registered
  methods, the same checkpoint-engine construction (``is_master`` on rank 0), and ``update_weights`` sends
  ``(name, full tensor)`` pairs of an HF state dict as verl's FSDP engine's ``get_per_tensor_param`` does.
  ``set_step(k)`` changes the weights deterministically (``weights_at``) so later updates differ.
- ``RecordingRollout`` is verl's ``CheckpointEngineWorkerTest`` (its ``MockServerAdapter`` unchanged) plus
  one method that returns what the adapter received, so the test can compare bytes.
"""

from __future__ import annotations

import torch
from tests.checkpoint_engine.test_utils import CheckpointEngineWorkerTest
from transformers import AutoModelForCausalLM
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.import_utils import import_external_libs


def weights_at(model_path: str, step: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors at step 1; step k > 1 adds a seeded perturbation (bf16, like the checkpoint)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.bfloat16, device_map="cpu")
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    if step > 1:
        g = torch.Generator().manual_seed(step)
        state = {n: (t.float() + torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in state.items()}
    return state


class StateTrainer(Worker):
    def __init__(self, model_path: str, checkpoint_engine_config) -> None:
        super().__init__()
        self.model_path = model_path
        backend = checkpoint_engine_config.backend
        import_external_libs(checkpoint_engine_config.custom_backend_module or None)
        bucket_size = checkpoint_engine_config.update_weights_bucket_megabytes << 20
        engine_kwargs = dict(checkpoint_engine_config.engine_kwargs.get(backend, {}))
        if self.rank == 0:
            engine_kwargs["is_master"] = True
        self.checkpoint_engine = CheckpointEngineRegistry.new(backend, bucket_size=bucket_size, **engine_kwargs)
        self.state = weights_at(model_path, 1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_step(self, step: int) -> None:
        self.state = weights_at(self.model_path, step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        await self.checkpoint_engine.send_weights(iter(self.state.items()), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sent_bytes(self) -> int:
        return int(self.checkpoint_engine.stats.get("bytes_sent", 0))


class RecordingRollout(CheckpointEngineWorkerTest):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> dict[str, torch.Tensor]:
        return dict(self.server_adapter.received_weights)
