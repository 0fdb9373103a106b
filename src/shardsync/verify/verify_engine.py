"""The ``shardsync`` backend as the tests and ``shardsync verify`` run it: the product's pull mode (``..engine``)
plus the roles only they need. The test registration (``plugin``) puts it in the product's place.

- Inspection: ``{"inspect_to": dir}`` as init info writes what each worker holds now (every tensor, probe
  outputs; ``inspection``) to ``{dir}/inspect_rank{R}.safetensors`` and returns: no plan, engine state untouched.
- Driver push: ``{"metadata": [m.to_dict() ...], "plan_dir": dir}`` as init info records each worker's plan
  from the metadata the driver passes (no producers); every update then carries each rank's packed groups
  (``push.pack_updates``), in one or more chunks per start/finish window::

      llm.init_weight_transfer_engine({"init_info": {"metadata": metas, "plan_dir": "/tmp/plans"}})
      plans = read_plans("/tmp/plans", world_size)              # each worker wrote the plan it recorded
      llm.start_weight_update()
      llm.update_weights({"update_info": pack_updates(plans, source, version=1)})   # one dict per rank
      llm.finish_weight_update(weight_version="1")

- The full baseline: ``{"op": "full", "version": v, "tensors": [[name, dtype, shape, bytes], ...]}``: every full
  tensor reaches every worker and vLLM's own loaders keep their share (what RPC/broadcast syncs do), processed
  by the same first-load processing; on a pull-mode engine too (the benchmark's baseline).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PlanError, SyncError
from ..types import ParamMeta, dtype_of
from ..integrations.vllm.worker_backend import ShardsyncEngine, ShardsyncInitInfo, ShardsyncUpdateInfo
from ..integrations.vllm.layerwise import vllm_context
from .inspection import write_inspection

__all__ = ["TestingEngine", "TestingInitInfo", "TestingUpdateInfo"]


@dataclass
class TestingInitInfo(ShardsyncInitInfo):
    metadata: list[dict[str, Any]] = field(default_factory=list)
    """Driver push: the trainer's ParamMeta list (``ParamMeta.to_dict()``), in the trainer's order."""

    def __post_init__(self) -> None:
        if self.inspect_to:
            return
        if not self.plan_dir and self.coordinator is None:
            raise ValueError("shardsync init_info needs 'plan_dir' (driver mode: workers write their plans there)")
        if not self.metadata and self.coordinator is None:
            raise ValueError("shardsync init_info needs 'metadata' (driver mode) or 'coordinator' (pull mode)")


@dataclass
class TestingUpdateInfo(ShardsyncUpdateInfo):
    plan_digest: str = ""
    groups: list[Any] = field(default_factory=list)
    """[[group name, packed bytes], ...] in transfer order."""
    op: str = "sync"
    """``sync`` (packed groups, or a pull in pull mode) or ``full`` (full tensors for vLLM's own loaders;
    the benchmark's baseline — processed by the same first-load processing)."""
    tensors: list[Any] = field(default_factory=list)
    """op ``full`` (the broadcast baseline): [[name, dtype, shape, bytes], ...] full tensors for vLLM's loaders."""

    def __post_init__(self) -> None:
        if self.op not in ("sync", "full"):
            raise ValueError(f"unknown shardsync update op {self.op!r}")


class TestingEngine(ShardsyncEngine):
    init_info_cls = TestingInitInfo
    update_info_cls = TestingUpdateInfo

    def init_transfer_engine(self, init_info: TestingInitInfo) -> None:
        if init_info.inspect_to and not init_info.check_fresh:  # read-only: what this engine holds now
            os.makedirs(init_info.inspect_to, exist_ok=True)
            write_inspection(self.model, os.path.join(init_info.inspect_to, f"inspect_rank{self.rank}.safetensors"))
            return
        super().init_transfer_engine(init_info)

    def _find_plan(self, init_info: TestingInitInfo, consumer: str, record) -> Any:
        if init_info.coordinator is not None:
            return super()._find_plan(init_info, consumer, record)
        return record([ParamMeta.from_dict(d) for d in init_info.metadata])  # driver push: no producers

    def receive_weights(self, info: TestingUpdateInfo) -> None:
        if info.op == "sync" and self.consumer is not None:  # pull mode: the product's
            super().receive_weights(info)
            return
        if self.plan is None or self.applier is None:
            raise SyncError(f"rank {self.rank}: update_weights before init_weight_transfer_engine")
        if not self._started or (self._received and (info.op != "sync" or self.consumer is not None)):
            # outside a start/finish window the layers are live kernel tensors, not checkpoint-format buffers
            raise SyncError(f"rank {self.rank}: update_weights needs start_weight_update first, and one pull per "
                            "start/finish window")
        self._received = True
        self._op = info.op
        with vllm_context(self.vllm_config):
            if info.op == "full":  # the baseline: every full tensor reaches every worker, vLLM's loaders keep a share
                self.held.pending = info.version
                self.held.writing(*self.held.groups)  # vLLM's loaders write any layer in any order
                self.model.load_weights([(n, torch.frombuffer(bytearray(b), dtype=dtype_of(d)).view(shape))
                                         for n, d, shape, b in info.tensors])
                for g in list(self.held.groups):
                    self.held.written(g)
                self._bytes = sum(len(t[3]) for t in info.tensors)
                return
            if info.plan_digest != self.plan.digest:
                raise PlanError(f"rank {self.rank}: update packed for plan {info.plan_digest[:12]!r}, this worker "
                                f"recorded {self.plan.digest[:12]!r}")
            self._check_newer(info.version)
            if self.held.pending is not None and info.version != self.held.pending:
                raise SyncError(f"rank {self.rank}: this window applies version {self.held.pending}; a chunk of "
                                f"version {info.version} was pushed into it")
            self.held.pending = info.version
            for gname, data in info.groups:
                if gname not in self.applier.layouts:
                    raise SyncError(f"rank {self.rank}: received group {gname!r}, which is not in its plan")
                expected = self.applier.layouts[gname].nbytes
                if len(data) != expected:
                    raise SyncError(f"rank {self.rank}: group {gname!r} has {len(data)} bytes, expected {expected}")
                buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8)
                self._apply(gname, buf)

    def _missing_groups(self) -> list[str]:
        return [] if self._op == "full" else super()._missing_groups()  # vLLM's loaders wrote every layer
