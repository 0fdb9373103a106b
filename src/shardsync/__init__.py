"""shardsync: move an RL trainer's fresh weights into vLLM workers, each worker pulling only its bytes.

The whole system on one line::

    WeightSource ──metadata──▶ consumer records its plan by a dry run of the engine's loaders (plan/record)
         │                                   │
         │                          route: each (consumer, group) → one producer (plan/route)
         ▼                                   ▼
    producer: gather group g → replay op chains → pack slices (plan/pack, engine/producer)
            → transport → consumer: unpack → scatter into the engine's buffers → engine processes layer

Wings, in the order data flows (dependencies point one way, right to left):
``cli`` → ``tools/`` (bench, baseline, demo, localcluster, sim) → ``integrations/`` (vllm) →
``engine/`` (producer, consumer, coordinator, control, loopback) → ``transport/`` and ``plan/`` (record,
groups, coverage, pack, route, opcodec, validate) → ``types``, ``errors``, ``source``.
``kernels/`` holds device kernels for the process step; ``zoo/`` tiny models with vLLM's loader semantics
(tests, benchmarks and the simulator only).
"""

from __future__ import annotations

from .plan.coverage import CoverageReport, check_coverage
from .errors import (CoverageError, MetadataMismatch, PlanError, ShardsyncError, SyncError, TransportError,
                     UnsupportedLoaderOp)
from .plan.groups import group_order, weight_group
from .engine.loopback import LocalConsumer, SyncReport, loopback_sync
from .plan.pack import GroupPacker, GroupUnpacker, layout_group, replay
from .plan.record import RecordingTensor, record_plan
from .source import ModuleSource, WeightSource
from .types import Fill, GroupPlan, Op, ParamMeta, Plan, Scatter

__all__ = [
    "WeightSource", "ModuleSource", "ParamMeta", "RecordingTensor", "record_plan", "Plan", "GroupPlan",
    "Scatter", "Fill", "Op", "weight_group", "group_order", "check_coverage", "CoverageReport", "layout_group",
    "replay", "GroupPacker", "GroupUnpacker", "LocalConsumer", "loopback_sync", "SyncReport", "ShardsyncError",
    "UnsupportedLoaderOp", "PlanError", "CoverageError", "MetadataMismatch", "SyncError", "TransportError",
]
