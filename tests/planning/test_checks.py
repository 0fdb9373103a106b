"""check_plan: a plan from the wire is refused unless every op is allow-listed and replays in bounds."""

from __future__ import annotations

import msgspec
import pytest

from shardsync.errors import PlanError
from shardsync.plan.checks import check_plan
from shardsync.plan.record import record_plan
from shardsync.source import ModuleSource
from shardsync.types import Op, StridedView
from shardsync.testing.zoo import ZooConfig, ZooModel, hf_state_dict

CFG = ZooConfig(experts=4, moe_layout="fused_t")


@pytest.fixture(scope="module")
def plan_and_metas():
    metas = ModuleSource(hf_state_dict(CFG)).metadata()
    dry = ZooModel(CFG, tp_size=2, tp_rank=1)
    plan = record_plan(metadata=metas, load_weights=dry.load_weights, params=dict(dry.named_parameters()),
                       consumer="r0/tp1")
    return plan, metas


def forge(plan, **changes):
    """The plan with its first layer group's first op-chain scatter changed."""
    gi = next(i for i, g in enumerate(plan.groups) if g.name.startswith("model.layers."))
    g = plan.groups[gi]
    si = next(i for i, s in enumerate(g.scatters) if s.ops)
    s = msgspec.structs.replace(g.scatters[si], **changes)
    g = msgspec.structs.replace(g, scatters=(*g.scatters[:si], s, *g.scatters[si + 1:]))
    return msgspec.structs.replace(plan, groups=(*plan.groups[:gi], g, *plan.groups[gi + 1:])), s


def test_a_recorded_plan_passes(plan_and_metas) -> None:
    plan, metas = plan_and_metas
    check_plan(plan, metas)


WHY = {"unknown_op": "op 'exp' is not one", "import_op": "op '__import__' is not one", "bad_arg": "does not decode",
       "huge_intermediate": "op 'expand' gives", "index_out_of_range": "outside a dimension",
       "bad_memory_format": "does not decode",
       "oob_view": "strided view reaches", "huge_shape": "more than 64x", "wrong_shape": "op chain gives shape",
       "unknown_source": "not a trainer tensor", "bad_dtype": "unknown dtype"}


@pytest.mark.parametrize("case", sorted(WHY))
def test_forged_plans_are_refused_naming_the_consumer(plan_and_metas, case: str) -> None:
    plan, metas = plan_and_metas
    _, s = forge(plan)
    changes = {
        "unknown_op": dict(ops=(Op(name="exp", fn=True),), view=None),
        "huge_intermediate": dict(view=None, ops=(Op(name="unsqueeze", args=(0,)), Op(name="expand", args=(1 << 24, -1, -1, -1)),
                                                  Op(name="narrow", args=(0, 0, 1)))),
        "index_out_of_range": dict(view=None, ops=(Op(name="index_select", args=(0, {"X": ["int64", [1], [10 ** 12]]})),)),
        "bad_memory_format": dict(view=None, ops=(Op(name="contiguous", kwargs={"memory_format": {"M": "save"}}),)),
        "import_op": dict(ops=(Op(name="__import__", fn=True, args=("os",)),), view=None),
        "bad_arg": dict(ops=(Op(name="narrow", args=({"Q": 1}, 0, 1)),), view=None),
        "oob_view": dict(view=StridedView(offset=10 ** 9, shape=s.shape, stride=(1,) * len(s.shape))),
        "huge_shape": dict(shape=(1 << 40,)),
        "wrong_shape": dict(shape=tuple(d + 1 for d in s.shape)),
        "unknown_source": dict(src="model.layers.0.not_a_tensor"),
        "bad_dtype": dict(dst_dtype="complex1024"),
    }[case]
    bad, _ = forge(plan, **changes)
    with pytest.raises(PlanError, match="consumer 'r0/tp1'") as ei:
        check_plan(bad, metas)
    assert WHY[case] in str(ei.value), str(ei.value)


def test_replay_itself_refuses_an_op_outside_the_allow_list() -> None:
    """Defence in depth: even a plan that reached a producer unchecked cannot make it call torch.save & co."""
    import torch

    from shardsync.errors import PlanError
    from shardsync.plan.pack import apply_op
    from shardsync.types import Op

    with pytest.raises(PlanError, match="'save' is not one the recorder produces"):
        apply_op(torch.zeros(2), Op(name="save", fn=True), ("/tmp/x",), {})
    assert apply_op(torch.arange(4.0), Op(name="narrow"), (0, 1, 2), {}).tolist() == [1.0, 2.0]
