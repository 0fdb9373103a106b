"""shardsync: move an RL trainer's fresh weights into vLLM workers, each worker pulling only its bytes.

The whole system on one line::

    WeightSource ──metadata──▶ consumer records its plan by a dry run of the engine's loaders (plan/record)
         │                                   │
         │                          route: each (consumer, group) → one producer (plan/route)
         ▼                                   ▼
    producer: gather group g → replay op chains → pack slices (plan/pack, engine/producer)
            → transport → consumer: unpack → scatter into the engine's buffers → engine processes layer

Wings, in the order data flows (dependencies point one way, right to left; docs/layout.md draws them):
``cli`` → ``programs/`` (demo, bench, chaos, simulate; source checkout only) → ``integrations/`` (vllm, ray,
verl) → ``verify/`` → ``engine/`` (``producer/``, ``consumer/``, ``coordinator/``, ``protocol/``,
``source_reads/``) → ``delta/`` and ``security/`` → ``transport/`` and ``plan/`` (record, groups, coverage, pack,
route, opcodec, validate) → ``config``, ``types``, ``errors``, ``source``. ``sources/`` holds the trainer-side
sources (FSDP2, Megatron); ``kernels/`` device kernels for the process step; ``testing/`` the test scaffolding
(zoo models, harness), kept out of the wheel.

The public API is ``__all__``: what a user calls. The runtime, the sharded sources and vLLM's init info load
on first use (PEP 562), so ``import shardsync`` imports neither vllm nor ray nor the runtime::

    from shardsync import FSDPSource, ShardsyncTrainerInitInfo          # vLLM's trainer API (imports vllm)
    from shardsync import ModuleSource, Producer, ProducerConfig        # or shardsync's own API

    prod = Producer(ModuleSource(model), ProducerConfig(rank=0, n_producers=1, n_consumers=1, token=token))

Planning internals (``RecordingTensor``, ``record_plan``, ``GroupPacker``, ...) stay importable from their
modules (``shardsync.plan.record``, ``shardsync.plan.pack``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import GroupSettings
from .errors import (AuthError, ChecksumError, ChunkMacError, ConsumerDropped, CoverageError, FrameMacError,
                     MetadataMismatch, NotMember, PlanError, ProducerLost, ShardsyncError, SyncError, TransportError,
                     UnsupportedLoaderOp)
from .source import ModuleSource, WeightSource
from .types import GroupPlan, ParamMeta, Plan

if TYPE_CHECKING:  # the lazy names, for type checkers and readers
    from .engine.consumer.consumer import Consumer
    from .engine.producer.producer import Producer, ProducerConfig
    from .integrations.skyrl import enable_skyrl
    from .integrations.trl.generation import enable_trl
    from .integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo
    from .sources.fsdp import FSDPSource
    from .sources.megatron import MegatronConfig, MegatronParallel, MegatronSource
    from .sources.quantize import BlockFP8Source

__all__ = [
    # trainer side
    "WeightSource", "ModuleSource", "FSDPSource", "MegatronSource", "MegatronConfig", "MegatronParallel",
    "BlockFP8Source", "Producer", "ProducerConfig",
    # inference side
    "Consumer", "ShardsyncTrainerInitInfo",
    # frameworks
    "enable_trl", "enable_skyrl",
    # the group-wide settings every surface embeds
    "GroupSettings",
    # what they exchange
    "ParamMeta", "Plan", "GroupPlan",
    # errors
    "ShardsyncError", "UnsupportedLoaderOp", "PlanError", "CoverageError", "MetadataMismatch", "TransportError",
    "AuthError", "FrameMacError", "ChecksumError", "ChunkMacError", "SyncError", "ConsumerDropped", "ProducerLost",
    "NotMember",
]


def __getattr__(name: str) -> Any:
    """PEP 562: load the module behind a lazy public name on first access (and keep it)."""
    if name in ("Producer", "ProducerConfig"):
        from .engine.producer import producer as mod
    elif name == "Consumer":
        from .engine.consumer import consumer as mod
    elif name == "FSDPSource":
        from .sources import fsdp as mod                            # torch.distributed.tensor
    elif name in ("MegatronSource", "MegatronConfig", "MegatronParallel"):
        from .sources import megatron as mod
    elif name == "BlockFP8Source":
        from .sources import quantize as mod
    elif name == "enable_trl":
        from .integrations.trl import generation as mod             # TRL's GRPOTrainer synced by shardsync
    elif name == "enable_skyrl":
        from .integrations import skyrl as mod                      # SkyRL's weight-sync strategy "shardsync"
    elif name == "ShardsyncTrainerInitInfo":
        from .integrations.vllm import trainer_backend as mod       # imports vllm; registers the "shardsync" backend
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
