"""First-load replay (integrations/vllm/first_load.py) on small modules: exact slot restore, state reset,
buffer views, and a quant method whose update branch differs from its first load (like vLLM's fused MoE)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from shardsync.errors import SyncError
from shardsync.integrations.vllm.first_load import (TensorSnapshot, capture_state, find_buffer_views, process_fresh,
                                               set_state)
from shardsync.integrations.vllm import first_load as fresh


class PackingMethod(QuantizeMethodBase):
    """Packs (reverses the rows of) the weight on its first processing only, like vLLM's unquantized
    fused-MoE method skipping the CPU prepack once ``moe_kernel`` is set."""

    dtypes: list[torch.dtype] = []  # default dtype at each processing (class-level: outlives state resets)

    def __init__(self) -> None:
        self.kernel = None

    def create_weights(self, *a, **k):  # pragma: no cover - not used
        pass

    def apply(self, layer, x, bias=None):  # pragma: no cover - not used
        return x

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        PackingMethod.dtypes.append(torch.get_default_dtype())
        if self.kernel is None:  # first load: pack into a new parameter, build the kernel
            layer.weight = nn.Parameter(layer.weight.data.flip(0).clone(), requires_grad=False)
            self.kernel = "built"
            layer.packed_note = "packed"
        # "weight update" branch: nothing (the bug class this module exists to avoid)


def make_layer() -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.arange(6, dtype=torch.bfloat16).reshape(3, 2), requires_grad=False)
    m.register_parameter("absent", None)  # CPU int8 layers keep ``weight = None`` entries like this
    m.quant_method = PackingMethod()
    return m


def test_snapshot_restores_exact_slots_none_entries_included() -> None:
    m = make_layer()
    m.register_buffer("alias", m.weight.data.view(-1), persistent=False)
    snap = TensorSnapshot.of(m)
    del m.absent, m.alias
    m.weight = nn.Parameter(torch.zeros(1), requires_grad=False)
    snap.place(m)
    assert "absent" in m._parameters and m._parameters["absent"] is None
    assert m.weight is snap.params["weight"] and m.alias is snap.buffers["alias"]
    assert m._non_persistent_buffers_set == {"alias"}


def test_set_state_removes_what_processing_added_and_isolates_containers() -> None:
    m = make_layer()
    m.table = {"a": 1}
    st = capture_state(m)
    m.cpu_linear = "closure"
    m.table["b"] = 2
    m.quant_method.kernel = "built"
    set_state(m, st)
    assert not hasattr(m, "cpu_linear") and m.table == {"a": 1} and m.quant_method.kernel is None


@pytest.mark.parametrize("mode", ["inplace", "rebind"])
def test_first_load_replay_gives_the_first_load_result_where_the_update_branch_does_not(mode, monkeypatch) -> None:
    live = make_layer()
    monkeypatch.setitem(fresh._FRESH, live, capture_state(live))  # what the plugin records at construction
    with torch.no_grad():
        live.quant_method.process_weights_after_loading(live)  # the first load
    kernel = TensorSnapshot.of(live)
    kernel_ptr = live.weight.data_ptr()
    new = torch.tensor([[10, 11], [12, 13], [14, 15]], dtype=torch.bfloat16)

    # vLLM's reload: checkpoint-format data processed by the live (post-load) quant method -> unpacked
    stale = make_layer()
    stale.quant_method.kernel = "built"
    stale.weight.data.copy_(new)
    stale.quant_method.process_weights_after_loading(stale)
    assert torch.equal(stale.weight, new)  # not what a fresh load holds (new.flip(0))

    live.weight = nn.Parameter(new.clone(), requires_grad=False)  # the sync wrote checkpoint-format data
    process_fresh(live, kernel=kernel, mode=mode, dtype=torch.bfloat16, name="layer")
    assert torch.equal(live.weight, new.flip(0))  # what a first load of `new` gives
    assert live._parameters["absent"] is None
    assert PackingMethod.dtypes[-1] == torch.bfloat16  # processed under the model dtype, not float32
    if mode == "inplace":
        assert live.weight.data_ptr() == kernel_ptr and live.weight is kernel.params["weight"]
        assert live.quant_method.kernel == "built"  # live kernel state kept
    else:
        assert live.packed_note == "packed"


def test_inplace_refuses_a_shape_change_and_leaves_the_live_layer() -> None:
    live = make_layer()
    fresh._FRESH[live] = capture_state(live)
    kernel = TensorSnapshot.of(live)
    kernel.params["weight"] = nn.Parameter(torch.zeros(4, 2, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(SyncError, match="layer 'L'.*weight.*cannot copy in place"):
        process_fresh(live, kernel=kernel, mode="inplace", dtype=torch.bfloat16, name="L")
    assert live.weight is kernel.params["weight"]


def test_buffer_views_of_another_modules_parameter_are_found() -> None:
    root = nn.Module()
    root.conv = nn.Module()
    root.conv.weight = nn.Parameter(torch.randn(4, 1, 3), requires_grad=False)
    root.mixer = nn.Module()
    root.mixer.register_buffer("conv_weights", root.conv.weight.data.view(4, 3), persistent=False)
    (v,) = find_buffer_views(root)
    assert (v.holder, v.buffer, v.owner, v.param, v.offset, v.shape) == ("mixer", "conv_weights", "conv", "weight",
                                                                          0, (4, 3))


# ---------------------------------------------------------------- direct writes (processor.check_direct)
class ScalingMethod(PackingMethod):
    """Identity on the weight, but keeps a plain value derived from it (a direct write would leave it stale)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.amax = float(layer.weight.float().abs().max())


class IdentityMethod(PackingMethod):
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


def _direct_case(method: type, live_weight: torch.Tensor | None = None):
    """A live layer processed once by ``method`` from its recorded first-load state, then what the check needs: the
    checkpoint format on meta, new checkpoint bytes, and a first load of them (tensors, state)."""
    live = make_layer()
    live.quant_method = method()
    if live_weight is not None:
        live.weight = nn.Parameter(live_weight, requires_grad=False)
    first = capture_state(live)
    with torch.no_grad():
        live.quant_method.process_weights_after_loading(live)
    state, kernel = capture_state(live), TensorSnapshot.of(live)
    ckpt = TensorSnapshot({"weight": torch.empty(3, 2, dtype=torch.bfloat16, device="meta"), "absent": None}, {}, set())
    new = torch.tensor([[10, 11], [12, 13], [14, 15]], dtype=torch.bfloat16)
    ref = make_layer()  # a first load of ``new``
    ref.quant_method = method()
    set_state(ref, first)
    ref.weight.data.copy_(new)
    with torch.no_grad():
        ref.quant_method.process_weights_after_loading(ref)
    t_ref = {n: t.detach().clone() for n, t in TensorSnapshot.of(ref).tensors().items()}
    return live, ckpt, kernel, {"weight": new}, state, capture_state(ref), t_ref


def test_direct_writes_are_taken_where_processing_is_the_identity_and_refused_elsewhere() -> None:
    from shardsync.integrations.vllm.processor import check_direct

    live, ckpt, kernel, inputs, state, st_ref, t_ref = _direct_case(IdentityMethod)
    ok, why = check_direct(live, ckpt, kernel, inputs, state, st_ref, t_ref, None)
    assert ok and why == ""
    assert kernel.params["weight"][0, 0] == 0  # checked on clones: the live tensor is never written

    live, ckpt, kernel, inputs, state, st_ref, t_ref = _direct_case(PackingMethod)  # processing flips the rows
    assert check_direct(live, ckpt, kernel, inputs, state, st_ref, t_ref, None) == (
        False, "processing changes ['weight']: the checkpoint bytes are not what the live tensors hold")

    live, ckpt, kernel, inputs, state, st_ref, t_ref = _direct_case(ScalingMethod)  # a value derived from the weight
    ok, why = check_direct(live, ckpt, kernel, inputs, state, st_ref, t_ref, None)
    assert not ok and "attribute 'amax' is 15.0 after processing random data, 5.0 live" in why

    transposed = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()  # same shape, other strides
    live, ckpt, kernel, inputs, state, st_ref, t_ref = _direct_case(IdentityMethod, transposed)
    ok, why = check_direct(live, ckpt, kernel, inputs, state, st_ref, t_ref, None)
    assert not ok and "live 'weight' is (3, 2) torch.bfloat16 strides (1, 3)" in why


def test_layout_mismatch_names_a_missing_or_reshaped_live_tensor() -> None:
    from shardsync.integrations.vllm.processor import layout_mismatch

    meta = TensorSnapshot({"weight": torch.empty(4, 2, device="meta")}, {"bias": torch.empty(4, device="meta")}, set())
    same = TensorSnapshot({"weight": torch.zeros(4, 2)}, {"bias": torch.zeros(4)}, set())
    assert layout_mismatch(meta, same) == ""
    assert layout_mismatch(meta, TensorSnapshot({"weight": torch.zeros(4, 2)}, {}, set())) == "no live tensor 'bias'"
    packed = TensorSnapshot({"weight": torch.zeros(8)}, {"bias": torch.zeros(4)}, set())
    assert "live 'weight' is (8,) torch.float32" in layout_mismatch(meta, packed)
    offset = TensorSnapshot({"weight": torch.zeros(9)[1:].view(4, 2)}, {"bias": torch.zeros(4)}, set())
    assert "offset 1" in layout_mismatch(meta, offset)
