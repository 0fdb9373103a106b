"""Fault-injection models for tests, registered in vLLM's ``ModelRegistry`` by ``register`` — in every vLLM process
where a test enabled them (``plugin.enable(models=True)`` / ``plugin.env(models=True)``, a ``vllm.general_plugins``
entry point named ``shardsync_testing_models``).

``ShardsyncScaledNormQwen3ForCausalLM`` is Qwen3 whose loader scales the final norm weight
(``w * 2``): arithmetic on a checkpoint tensor, which no trainer-side view can replay, so
``model.norm.weight`` takes the fallback path (sent whole, loaded by the real loader at sync time).
"""

from __future__ import annotations

from typing import Iterable

import torch
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

ARCH = "ShardsyncScaledNormQwen3ForCausalLM"


class ShardsyncScaledNormQwen3ForCausalLM(Qwen3ForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, t * 2 if n == "model.norm.weight" else t) for n, t in weights)


def register() -> None:
    """The test models (once per process)."""
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, f"{__name__}:{ARCH}")
