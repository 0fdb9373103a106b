"""Init-time validation: the plan is checked against the real loaders on random data."""

from __future__ import annotations

import pytest

from shardsync.errors import PlanError
from shardsync.plan.record import record_plan
from shardsync.source import ModuleSource
from shardsync.plan.validate import validate_group
from shardsync.zoo import ZooConfig, ZooModel, hf_state_dict


class SneakyNorm(ZooModel):
    """Writes the final norm through a NumPy view as well: invisible to the recording."""

    def load_weights(self, weights):
        out = super().load_weights(weights)
        self.model.norm.weight.data.numpy()[0] = 42.0
        return out


def _check(model_cls, cfg) -> int:
    metas = ModuleSource(hf_state_dict(cfg)).metadata()
    model = model_cls(cfg, tp_size=2, tp_rank=1)
    params = dict(model.named_parameters())
    plan = record_plan(metadata=metas, load_weights=model.load_weights, params=params, rank=1)
    n = 0
    for g in plan.groups:
        n += validate_group(load_weights=model.load_weights, params=params, group=g,
                            metas=[m for m in metas if m.name in g.sources], rank=1)
    return n


def test_validation_passes_for_faithful_loaders() -> None:
    assert _check(ZooModel, ZooConfig.qwen3_moe_tiny(dtype="float32")) > 0


def test_validation_names_the_tensor_a_loader_writes_behind_the_recordings_back() -> None:
    with pytest.raises(PlanError, match=r"rank 1 on tensor 'model\.norm\.weight'"):
        _check(SneakyNorm, ZooConfig.qwen3_moe_tiny(dtype="float32"))
