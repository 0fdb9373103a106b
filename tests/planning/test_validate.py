"""Init-time validation: the plan is checked against the real loaders on random data."""

from __future__ import annotations

import pytest

from shardsync.errors import PlanError
from shardsync.plan.record import record_plan
from shardsync.source import ModuleSource
from shardsync.plan.validate import validate_group
from shardsync.testing.zoo import ZooConfig, ZooModel, hf_state_dict


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


def test_a_trainer_shape_the_engines_checkpoint_lacks_is_refused_naming_both(tmp_path) -> None:
    """The engine's checkpoint (its safetensors headers) is the reference: a trainer tensor of another shape is
    refused before any plan is recorded; other dtypes (the loaders cast) and names the checkpoint lacks pass."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from shardsync.errors import MetadataMismatch
    from shardsync.integrations.vllm.checkpoint_shapes import checkpoint_shapes, refuse_foreign_shapes
    from shardsync.types import ParamMeta

    save_file({"a.weight": torch.zeros(256, 64), "b.weight": torch.zeros(8, dtype=torch.bfloat16)},
              str(tmp_path / "model-00001.safetensors"))
    save_file({"c.weight": torch.zeros(2, 3)}, str(tmp_path / "model-00002.safetensors"))
    assert checkpoint_shapes(str(tmp_path)) == {"a.weight": (256, 64), "b.weight": (8,), "c.weight": (2, 3)}
    assert checkpoint_shapes(str(tmp_path / "nowhere")) is None
    cfg = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path)))
    ok = [ParamMeta(name="a.weight", dtype="bfloat16", shape=(256, 64)), ParamMeta(name="b.weight", dtype="float32",
                                                                                  shape=(8,)),
          ParamMeta(name="extra.weight", dtype="float32", shape=(5,))]
    refuse_foreign_shapes(ok, cfg, rank=0)
    refuse_foreign_shapes([ParamMeta(name="a.weight", dtype="float32", shape=(1,))],
                          SimpleNamespace(model_config=SimpleNamespace(model="org/hub-id")), rank=0)  # no reference
    wide = ok[:1] + [ParamMeta(name="c.weight", dtype="float32", shape=(3, 3))]
    with pytest.raises(MetadataMismatch, match=r"rank 3: 1 trainer tensor\(s\).*'c.weight': trainer \[3, 3\], "
                                               r"engine \[2, 3\]"):
        refuse_foreign_shapes(wide, cfg, rank=3)
