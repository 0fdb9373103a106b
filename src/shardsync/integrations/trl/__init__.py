"""TRL integration: ``GRPOTrainer`` (and the trainers sharing TRL's ``VLLMGeneration``) synced by shardsync.

One line before the trainer is built selects it (``vllm_mode="colocate"`` or ``"server"``)::

    from shardsync import enable_trl     # or shardsync.integrations.trl.enable
    enable_trl()

``generation`` holds the class and the source over TRL's parameters; see ``docs/adoption.md`` (TRL).
"""

from .generation import SETTINGS, TRLParams, enable, enable_trl

__all__ = ["enable", "enable_trl", "TRLParams", "SETTINGS", "ShardsyncVLLMGeneration"]


def __getattr__(name: str):
    if name == "ShardsyncVLLMGeneration":
        from . import generation

        return generation.ShardsyncVLLMGeneration
    raise AttributeError(name)
