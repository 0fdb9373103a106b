"""verl integration: a ``CheckpointEngine`` backend named ``"shardsync"`` (extra ``shardsync[verl]``).

Importing this package registers the backend with verl's ``CheckpointEngineRegistry``; its path is what
verl's ``checkpoint_engine.custom_backend_module`` names::

    actor_rollout_ref.rollout.checkpoint_engine.backend=shardsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=shardsync.integrations.verl

Files: ``backend`` (the engine: verl's lifecycle), ``stream`` (trainer side: verl's one-pass generator as a
WeightSource, each tensor served by one rank), ``rollout_receiver`` (rollout side: an identity-plan consumer yielding
full tensors), ``rendezvous`` (how the group finds trainer rank 0's coordinator). See ``docs/verl.md``.
"""

from .backend import ShardsyncCheckpointEngine

__all__ = ["ShardsyncCheckpointEngine"]
