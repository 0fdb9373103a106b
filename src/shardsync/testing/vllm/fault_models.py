"""Fault-injection models for tests, registered in vLLM's ``ModelRegistry`` by ``register`` — in every vLLM process
where a test enabled them (``plugin.enable(models=True)`` / ``plugin.env(models=True)``, a ``vllm.general_plugins``
entry point named ``shardsync_testing_models``).

``ShardsyncScaledNormQwen3ForCausalLM`` is Qwen3 whose loader scales the final norm weight
(``w * 2``): arithmetic on a checkpoint tensor, which no trainer-side view can replay, so
``model.norm.weight`` takes the fallback path (sent whole, loaded by the real loader at sync time).

``ShardsyncReprocessFailsQwen3ForCausalLM`` is Qwen3 whose first MLP down projection processes its weights once (the
first load) and raises on any later run: shardsync's init-time processing check fails on it, which must refuse the
sync backend and leave the engine serving.
"""

from __future__ import annotations

from typing import Iterable

import torch
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

ARCH = "ShardsyncScaledNormQwen3ForCausalLM"
REPROCESS_FAILS = "ShardsyncReprocessFailsQwen3ForCausalLM"


class ShardsyncScaledNormQwen3ForCausalLM(Qwen3ForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, t * 2 if n == "model.norm.weight" else t) for n, t in weights)


class ShardsyncReprocessFailsQwen3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        qm = self.model.layers[0].mlp.down_proj.quant_method
        first_load, runs = qm.process_weights_after_loading, []

        def process_once(layer: torch.nn.Module) -> None:
            runs.append(1)
            if len(runs) > 1:
                raise RuntimeError("injected: model.layers.0.mlp.down_proj processes its weights only once")
            first_load(layer)
        qm.process_weights_after_loading = process_once


def register() -> None:
    """The test models (once per process)."""
    from vllm import ModelRegistry

    for arch in (ARCH, REPROCESS_FAILS):
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"{__name__}:{arch}")
