"""shardsync: move an RL trainer's fresh weights into vLLM workers, each worker pulling only its bytes.

The whole system on one line::

    WeightSource ──metadata──▶ consumer records its plan by a dry run of the engine's loaders (record.py)
         │                                   │
         ▼                                   ▼
    producer: gather group g → replay op chains → pack slices (pack.py)
            → transport → consumer: unpack → scatter into the engine's buffers → engine processes layer

Modules, in the order data flows: ``types`` (pure records) · ``source`` (trainer API) · ``record``
(RecordingTensor, dry run → plan) · ``groups`` (weight groups) · ``coverage`` · ``pack`` (layout,
replay, pack/unpack) · ``loopback`` (in-process sync) · ``integrations.vllm`` (vLLM backend).
"""

from __future__ import annotations

from .coverage import CoverageReport, check_coverage
from .errors import (CoverageError, MetadataMismatch, PlanError, ShardsyncError, SyncError, TransportError,
                     UnsupportedLoaderOp)
from .groups import group_order, weight_group
from .loopback import LocalConsumer, SyncReport, loopback_sync
from .pack import GroupPacker, GroupUnpacker, layout_group, replay
from .record import RecordingTensor, record_plan
from .source import ModuleSource, WeightSource
from .types import Fill, GroupPlan, Op, ParamMeta, Plan, Scatter

__all__ = [
    "WeightSource", "ModuleSource", "ParamMeta", "RecordingTensor", "record_plan", "Plan", "GroupPlan",
    "Scatter", "Fill", "Op", "weight_group", "group_order", "check_coverage", "CoverageReport", "layout_group",
    "replay", "GroupPacker", "GroupUnpacker", "LocalConsumer", "loopback_sync", "SyncReport", "ShardsyncError",
    "UnsupportedLoaderOp", "PlanError", "CoverageError", "MetadataMismatch", "SyncError", "TransportError",
]
