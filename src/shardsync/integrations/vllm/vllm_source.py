"""shardsync's ``WeightSource`` as vLLM's (the other half of ``sources.adapt``): hand a shardsync source
(``FSDPSource``, ``MegatronSource``, ``ModuleSource``) to any vLLM trainer backend (``nccl``, ``ipc``) unchanged.

    engine = WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(...), client=llm_client,
                                                       source=as_vllm_source(FSDPSource(model)))
"""

from __future__ import annotations

from typing import Collection, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta as VllmParamMeta
from vllm.distributed.weight_transfer.base import WeightSource as VllmWeightSource

from ...source import WeightSource

__all__ = ["as_vllm_source", "VllmView"]


class VllmView(VllmWeightSource):
    """A vLLM ``WeightSource`` over a shardsync one (``shardsync_source`` is the wrapped source)."""

    def __init__(self, source: WeightSource):
        self.shardsync_source = source

    def metadata(self) -> list[VllmParamMeta]:
        return [VllmParamMeta(m.name, getattr(torch, m.dtype), tuple(m.shape))
                for m in self.shardsync_source.metadata()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.shardsync_source)  # type: ignore[arg-type]

    def held_names(self) -> Collection[str] | None:
        return self.shardsync_source.held_names()

    def groups(self) -> list[list[str]]:
        return self.shardsync_source.groups()

    def iter_groups(self):
        return self.shardsync_source.iter_groups()


def as_vllm_source(source: WeightSource | VllmWeightSource) -> VllmWeightSource:
    """A vLLM ``WeightSource`` for ``source`` (vLLM's own pass through unchanged)."""
    if isinstance(source, VllmWeightSource):
        return source
    return VllmView(source)
