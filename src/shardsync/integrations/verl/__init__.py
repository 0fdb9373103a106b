"""verl integration: a ``CheckpointEngine`` backend named ``"shardsync"`` (extra ``shardsync[verl]``).

Importing this package registers the backend with verl's ``CheckpointEngineRegistry``; its path is what
verl's ``checkpoint_engine.custom_backend_module`` names::

    actor_rollout_ref.rollout.checkpoint_engine.backend=shardsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=shardsync.integrations.verl

Files: ``backend`` (the engine: verl's lifecycle), ``rendezvous`` (how the group finds trainer rank 0's
coordinator). The trainer side's source is ``sources/stream.py`` (verl's one-pass generator as a WeightSource, each
tensor served by one rank), the rollout side's consumer ``engine/consumer/tensor_receiver.py`` (an identity plan
yielding full tensors); SkyRL's strategy uses both too. See ``docs/verl.md``.
"""

from .backend import ShardsyncCheckpointEngine

__all__ = ["ShardsyncCheckpointEngine"]
