"""The zoo consumer, written once: one inference rank with vLLM's loader semantics (a loader-zoo model), its plan
recorded by a dry run of its own loaders, and an ``apply`` that unpacks each group into its live parameters.

    z = ZooConsumer(cfg, "r0/tp1", tp=2, tp_rank=1)
    cons = Consumer(z.id, coordinator, token=t, record=z.record, apply=z.apply)    # the engine's consumer
    local = z.local(source.metadata())                                             # or the in-process loopback
    assert not z.mismatched(hf_state_dict(cfg, seed=v))     # vs its own loaders run on the full tensors of v

Used by the local cluster's consumer processes, the Ray zoo engines, ``shardsync demo --consumers zoo``,
``benchmarks/gpu_sync.py`` and the tests.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ...engine.inprocess import LocalConsumer
from ...plan.pack import GroupUnpacker, layout_group
from ...plan.readback import ParamsReadBack
from ...plan.record import record_plan
from ...plan.split import split_to_budget
from ...plan.validate import mismatched
from ...types import ParamMeta, Plan
from ..zoo import ZooConfig, ZooModel

__all__ = ["ZooConsumer", "zoo_plan"]


def zoo_plan(cfg: ZooConfig, metas: Sequence[ParamMeta], consumer: str, *, tp: int = 1, tp_rank: int = 0,
             ep: int = 1, ep_rank: int = 0) -> Plan:
    """The plan of one zoo rank: its loaders run on recording tensors into a model on the meta device."""
    with torch.device("meta"):
        dry = ZooModel(cfg, tp_size=tp, tp_rank=tp_rank, ep_size=ep, ep_rank=ep_rank)
    return record_plan(metadata=list(metas), load_weights=dry.load_weights, params=dict(dry.named_parameters()),
                       consumer=consumer, rank=tp_rank)


class ZooConsumer:
    """One zoo rank: ``live`` (on ``device``), ``record`` (the engine's recorder) and ``apply`` (a
    ``GroupUnpacker`` per group, built on first use); ``on_apply(group)`` runs after each group's bytes are in."""

    def __init__(self, cfg: ZooConfig, consumer_id: str, *, tp: int = 1, tp_rank: int = 0, ep: int = 1,
                 ep_rank: int = 0, device: str | torch.device | None = None,
                 on_apply: Callable[[str], None] | None = None, sync_memory_bytes: int | None = None):
        self.cfg, self.id, self.on_apply, self.device = cfg, consumer_id, on_apply, device
        self.sync_memory_bytes = sync_memory_bytes
        """As the engine's (``GroupSettings.sync_memory_bytes``): groups above half of it are recorded in parts."""
        self.rank_kw = dict(tp_size=tp, tp_rank=tp_rank, ep_size=ep, ep_rank=ep_rank)
        self.live = self.model(device)
        self.params: dict[str, torch.Tensor] = {n: p.detach() for n, p in self.live.named_parameters()}
        self.plan: Plan | None = None
        self.unpackers: dict[str, GroupUnpacker] = {}

    def model(self, device: str | torch.device | None = None, cfg: ZooConfig | None = None) -> ZooModel:
        """A fresh model of this rank (zeros), e.g. a reference to load full tensors into."""
        with torch.device(device if device is not None else "cpu"):
            return ZooModel(cfg or self.cfg, **self.rank_kw)

    def record(self, metas: Sequence[ParamMeta]) -> Plan:
        k = self.rank_kw
        plan = zoo_plan(self.cfg, metas, self.id, tp=k["tp_size"], tp_rank=k["tp_rank"], ep=k["ep_size"],
                        ep_rank=k["ep_rank"])
        self.plan = split_to_budget(plan, metas, self.sync_memory_bytes)
        self.unpackers.clear()
        return self.plan

    def unpacker(self, group: str) -> GroupUnpacker:
        if group not in self.unpackers:
            assert self.plan is not None, "record() first"
            g = self.plan.group(group)
            self.unpackers[group] = GroupUnpacker(g, layout_group(g))
        return self.unpackers[group]

    def read_back(self, plan: Plan) -> ParamsReadBack:
        """``Consumer(read_back=)``: nothing processes a zoo rank's parameters after the copy, so every one whose
        regions are its own is a delta's base (``plan/readback.py``)."""
        return ParamsReadBack(plan, self.params, self.params.keys())

    def apply(self, group: str, buf: torch.Tensor) -> None:
        self.unpacker(group).unpack(buf, self.params)
        if self.on_apply is not None:
            self.on_apply(group)

    def local(self, metas: Sequence[ParamMeta], **kw) -> LocalConsumer:
        """This rank as an in-process consumer of ``engine.loopback`` (its plan recorded now)."""
        return LocalConsumer(self.record(metas), self.params, **kw)

    def reference(self, state: Mapping[str, torch.Tensor]) -> ZooModel:
        """What this rank's own loaders make of the full tensors ``state``."""
        ref = self.model(self.device)
        ref.load_weights(state.items())
        return ref

    def mismatched(self, state: Mapping[str, torch.Tensor]) -> list[str]:
        """The parameters whose bytes differ from :meth:`reference` on ``state`` (empty: exact)."""
        return mismatched(self.live.state_dict(), self.reference(state).state_dict())
