"""RecordingTensor: every supported view-like op replays bit-exactly; everything else is refused by name."""

from __future__ import annotations

import pytest
import torch

from helpers import raw
from shardsync.plan.coverage import check_coverage
from shardsync.errors import CoverageError, UnsupportedLoaderOp
from shardsync.engine.inprocess import LocalConsumer, loopback_sync
from shardsync.plan.pack import replay
from shardsync.plan.record import RecordingTensor, record_plan
from shardsync.source import ModuleSource
from shardsync.types import ParamMeta

W = torch.arange(2 * 6 * 8, dtype=torch.float32).reshape(2, 6, 8).to(torch.bfloat16) + 0.5

CHAINS = {
    "narrow": lambda w: w.narrow(1, 2, 3),
    "torch.narrow": lambda w: torch.narrow(w, 2, 1, 5),
    "view": lambda w: w.view(12, 8),
    "view_dtype": lambda w: w.view(torch.int16),
    "view_dtype_wider": lambda w: w.view(torch.int32),
    "reshape_view": lambda w: w.reshape(-1, 4),
    "reshape_copy": lambda w: w.transpose(1, 2).reshape(2, 48),
    "transpose": lambda w: w.transpose(0, 2),
    "t": lambda w: w[0].t(),
    "T_property": lambda w: w[1].T,
    "mT": lambda w: w.mT,
    "permute": lambda w: w.permute(2, 0, 1),
    "flatten": lambda w: w.flatten(1),
    "unflatten": lambda w: w.unflatten(2, (2, 4)),
    "squeeze_unsqueeze": lambda w: w.unsqueeze(0).unsqueeze(3).squeeze(0).squeeze(2),
    "contiguous_after_t": lambda w: w[0].t().contiguous(),
    "chunk": lambda w: w.chunk(3, dim=1)[2],
    "torch.chunk": lambda w: torch.chunk(w, 2, 2)[1],
    "split_size": lambda w: w.split(4, dim=2)[1],
    "split_sizes": lambda w: w.split([1, 2, 3], dim=1)[1],
    "torch.split": lambda w: torch.split(w, [5, 3], dim=2)[0],
    "unbind": lambda w: w.unbind(0)[1],
    "select": lambda w: w.select(1, 4),
    "getitem_int": lambda w: w[1],
    "getitem_slices": lambda w: w[:, 1:5:2, ::3],
    "getitem_ellipsis_none": lambda w: w[..., None, 2:6],
    "getitem_negative": lambda w: w[-1, -2],
    "expand": lambda w: w[:, :1].expand(2, 4, 8),
    "movedim": lambda w: w.movedim(0, 2),
    "swapaxes": lambda w: w.swapaxes(0, 1),
    "detach_clone": lambda w: w.detach().clone().narrow(0, 1, 1),
    "view_as": lambda w: w.view_as(torch.empty(48, 2)),
    "long_chain": lambda w: w.transpose(0, 1).narrow(0, 1, 4).chunk(2, dim=0)[1].reshape(2, -1)[:, 3:],
}


def _record_single(chain, w=W, dest_dtype=None):
    ref_slice = chain(w)
    dest = torch.zeros(ref_slice.shape, dtype=dest_dtype or ref_slice.dtype)
    params = {"p": dest}
    meta = [ParamMeta.of("ckpt", w)]
    plan = record_plan(metadata=meta, load_weights=lambda ws: [params["p"].copy_(chain(t)) for _, t in ws],
                       params=params)
    return plan, ref_slice


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_view_op_replays_bit_exact(name: str) -> None:
    plan, ref = _record_single(CHAINS[name])
    (s,) = plan.groups[0].scatters
    got = replay(s, W)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.equal(raw(got), raw(ref))
    # end to end: pack + unpack into a fresh destination equals the loader's copy
    live = {"p": torch.zeros(ref.shape, dtype=ref.dtype)}
    loopback_sync(ModuleSource({"ckpt": W}), [LocalConsumer(plan, live)])
    assert torch.equal(raw(live["p"]), raw(ref))


def test_strided_views_are_folded_and_copies_are_not() -> None:
    folded = _record_single(lambda w: w.transpose(0, 1).narrow(0, 1, 4).chunk(2, dim=0)[1][:, :, 3:])
    assert folded[0].groups[0].scatters[0].view is not None
    assert _record_single(CHAINS["long_chain"])[0].groups[0].scatters[0].view is None
    assert _record_single(CHAINS["reshape_copy"])[0].groups[0].scatters[0].view is None
    assert _record_single(CHAINS["view_dtype"])[0].groups[0].scatters[0].view is None


@pytest.mark.parametrize("dest_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtype_converting_copy(dest_dtype) -> None:
    w = torch.randn(5, 7, dtype=torch.float32) * 3
    plan, _ = _record_single(lambda t: t.narrow(1, 1, 4), w=w, dest_dtype=dest_dtype)
    s = plan.groups[0].scatters[0]
    assert (s.src_dtype, s.dst_dtype) == ("float32", str(dest_dtype).removeprefix("torch."))
    ref = torch.zeros(5, 4, dtype=dest_dtype)
    ref.copy_(w.narrow(1, 1, 4))
    live = {"p": torch.zeros(5, 4, dtype=dest_dtype)}
    loopback_sync(ModuleSource({"ckpt": w}), [LocalConsumer(plan, live)])
    assert torch.equal(raw(live["p"]), raw(ref))


def test_setitem_into_parameter_is_recorded() -> None:
    w = torch.randn(6, 4).to(torch.bfloat16)
    params = {"p": torch.zeros(10, 4, dtype=torch.bfloat16)}

    def load(ws):
        for _, t in ws:
            params["p"][2:8] = t
    plan = record_plan(metadata=[ParamMeta.of("ckpt", w)], load_weights=load, params=params)
    (s,) = plan.groups[0].scatters
    assert s.dst_byte_offset == 2 * 4 * 2 and s.shape == (6, 4)
    live = {"p": torch.zeros(10, 4, dtype=torch.bfloat16)}
    loopback_sync(ModuleSource({"ckpt": w}), [LocalConsumer(plan, live)])
    assert torch.equal(raw(live["p"][2:8]), raw(w)) and not live["p"][:2].any() and not live["p"][8:].any()


def test_metadata_queries_do_not_record() -> None:
    seen = {}

    def load(ws):
        for _, t in ws:
            seen.update(shape=tuple(t.shape), size=t.size(0), dim=t.dim(), numel=t.numel(), dtype=t.dtype,
                        device=t.device, contig=t.is_contiguous(), ndim=t.ndim, stride=t.stride(), r=repr(t))
            params["p"].copy_(t)
    params = {"p": torch.zeros(3, 4)}
    plan = record_plan(metadata=[ParamMeta(name="x", dtype="float32", shape=(3, 4))], load_weights=load, params=params)
    assert seen["shape"] == (3, 4) and seen["size"] == 3 and seen["numel"] == 12 and seen["dtype"] == torch.float32
    assert seen["device"] == torch.device("cpu") and seen["stride"] == (4, 1) and "RecordingTensor('x'" in seen["r"]
    assert plan.groups[0].scatters[0].ops == ()


UNSUPPORTED = {
    "add": lambda t, p: p.copy_(t + 1),
    "mul_inplace": lambda t, p: t.mul_(2),
    "to_dtype": lambda t, p: p.copy_(t.to(torch.float32)),
    "float": lambda t, p: p.copy_(t.float()),
    "item": lambda t, p: t[0, 0].item(),
    "tolist": lambda t, p: t.tolist(),
    "bool": lambda t, p: bool(t[0, 0]),
    "cat": lambda t, p: p.copy_(torch.cat([t[:1], t[1:]])),
    "broadcast_copy": lambda t, p: p.copy_(t[:1]),
    "copy_into_temporary": lambda t, p: torch.zeros_like(p).copy_(t),
    "float_index": lambda t, p: p.copy_(t[torch.tensor([0.0, 1.0, 2.0])]),
    "exp": lambda t, p: p.copy_(torch.exp(t)),
    "copy_into_ckpt": lambda t, p: t.copy_(p),
    "numpy": lambda t, p: t.numpy(),
}


@pytest.mark.parametrize("op", sorted(UNSUPPORTED))
def test_unsupported_op_raises_typed_error_naming_tensor_op_and_chain(op: str) -> None:
    params = {"p": torch.zeros(3, 4, dtype=torch.bfloat16)}
    meta = [ParamMeta(name="model.layers.0.mlp.w", dtype="bfloat16", shape=(3, 4))]
    with pytest.raises(UnsupportedLoaderOp) as ei:
        record_plan(metadata=meta, load_weights=lambda ws: [UNSUPPORTED[op](t.narrow(0, 0, 3), params["p"])
                                                           for _, t in ws], params=params, rank=3)
    msg = str(ei.value)
    assert "model.layers.0.mlp.w" in msg and "rank 3" in msg and "narrow(0, 0, 3)" in msg
    assert ei.value.tensor == "model.layers.0.mlp.w" and ei.value.op


def test_unneeded_names_and_coverage() -> None:
    params = {"a": torch.zeros(4, 2), "b": torch.zeros(4, 2), "c": torch.zeros(3)}
    metas = [ParamMeta(name=n, dtype="float32", shape=(4, 2)) for n in ("x", "y", "z")]

    def load(ws):
        for n, t in ws:
            if n == "x":
                params["a"].copy_(t)
            elif n == "y":
                params["b"][:2].copy_(t[2:])
    plan = record_plan(metadata=metas, load_weights=load, params=params)
    assert plan.unneeded == ("z",)
    rep = check_coverage(plan, params)
    assert rep.full == ["a"] and rep.partial == {"b": [16, 32]} and rep.missing == ["c"]
    with pytest.raises(CoverageError, match="b: 16/32 bytes"):
        rep.raise_if_incomplete()
    rep.raise_if_incomplete(ignore=frozenset({"b", "c"}))


def test_recording_tensor_has_no_storage() -> None:
    from shardsync.plan.record import Recorder
    rt = Recorder(lambda d: None).tensor(ParamMeta(name="big", dtype="bfloat16", shape=(1 << 20, 1 << 14)))
    assert isinstance(rt, RecordingTensor) and rt.shape == (1 << 20, 1 << 14)  # 32 GiB, never allocated
    with pytest.raises(UnsupportedLoaderOp, match="'big'"):
        rt.untyped_storage()


def test_constant_fills_are_recorded_in_order_and_other_param_writes_refused() -> None:
    w = torch.randn(4, 3)
    params = {"p": torch.zeros(6, 3)}

    def load(ws):
        for _, t in ws:
            params["p"].zero_()              # before the copy: must not wipe it at replay
            params["p"][:4].copy_(t)
            params["p"][4:].fill_(7.0)       # padding rows after it
    plan = record_plan(metadata=[ParamMeta.of("x", w)], load_weights=load, params=params)
    assert not params["p"].any()  # the dry run wrote nothing into the parameter
    (g,) = plan.groups
    assert [(f.pos, f.value, f.shape) for f in g.fills] == [(0, 0, (6, 3)), (1, 7.0, (2, 3))]
    live = {"p": torch.full((6, 3), float("nan"))}
    loopback_sync(ModuleSource({"x": w}), [LocalConsumer(plan, live)])
    ref = torch.cat([w, torch.full((2, 3), 7.0)])
    assert torch.equal(raw(live["p"]), raw(ref))
    assert check_coverage(plan, params).complete

    def bad(ws):
        for _, t in ws:
            params["p"][:4].copy_(t)
            params["p"].mul_(2)
    with pytest.raises(UnsupportedLoaderOp, match=r"mul_ on parameter 'p'.*'x'|'x'.*mul_ on parameter 'p'"):
        record_plan(metadata=[ParamMeta.of("x", w)], load_weights=bad, params=params)


@pytest.mark.parametrize("how", ["getitem_tensor", "getitem_list", "index_select", "bool_mask"])
def test_constant_index_gathers_are_recorded_and_replayed(how: str) -> None:
    """Expert-parallel loaders pick their local experts with an index tensor fixed at init
    (``w[local_expert_ids]``); the indices become constants of the plan and the gather is replayed."""
    full = torch.arange(6 * 4 * 2, dtype=torch.float32).reshape(6, 4, 2)
    idx = torch.tensor([1, 4, 5])
    params = {"p": torch.zeros(3, 2, 4)}
    pick = {"getitem_tensor": lambda t: t[idx], "getitem_list": lambda t: t[[1, 4, 5]],
            "index_select": lambda t: t.index_select(0, idx),
            "bool_mask": lambda t: t[torch.tensor([False, True, False, False, True, True])]}[how]
    meta = [ParamMeta(name="model.layers.0.mlp.experts.w", dtype="float32", shape=(6, 4, 2))]
    plan = record_plan(metadata=meta, load_weights=lambda ws: [params["p"].copy_(pick(t).transpose(-1, -2))
                                                               for _, t in ws], params=params)
    (s,) = plan.groups[0].scatters
    assert s.view is None  # a gather copies: replayed op by op, not folded into a strided view
    assert torch.equal(replay(s, full), full[[1, 4, 5]].transpose(-1, -2))
    again = type(plan).from_json(plan.to_json())  # the constants survive the wire format
    assert torch.equal(replay(again.groups[0].scatters[0], full), full[[1, 4, 5]].transpose(-1, -2))


def test_unrecordable_tensor_takes_the_fallback_path_and_validates() -> None:
    """With allow_fallback, a tensor whose loader computes values becomes a Fallback (sent whole,
    loaded by the real loader at sync time); the dry run goes on with the tensors after it."""
    from shardsync.plan.validate import validate_group
    from shardsync.types import FALLBACK_PREFIX

    params = {"a": torch.zeros(4, 2), "A": torch.zeros(3), "c": torch.zeros(2, 2)}

    def load(ws):
        for n, t in ws:
            if n == "a":
                params["a"].copy_(t.narrow(0, 0, 4))
            elif n == "A_log":  # Mamba2-style: narrow, copy, then a computed value written in place
                params["A"].copy_(t.narrow(0, 1, 3))
                params["A"].data.copy_(-torch.exp(params["A"].float()))
            else:
                params["c"].copy_(t.view(2, 2))
    metas = [ParamMeta(name="model.layers.0.a", dtype="float32", shape=(6, 2)),
             ParamMeta(name="model.layers.0.A_log", dtype="float32", shape=(4,)),
             ParamMeta(name="model.layers.0.c", dtype="float32", shape=(4,))]

    def load_named(ws):
        load((n.rsplit(".", 1)[1], t) for n, t in ws)
    with pytest.raises(UnsupportedLoaderOp, match="model.layers.0.A_log"):
        record_plan(metadata=metas, load_weights=load_named, params=params)
    plan = record_plan(metadata=metas, load_weights=load_named, params=params, allow_fallback=True)
    (fb,) = plan.fallback
    assert fb.src == "model.layers.0.A_log" and fb.dests == ("A",) and "copy_" in fb.reason
    (g,) = plan.groups
    assert [s.dst for s in g.scatters] == ["a", "c", FALLBACK_PREFIX + "model.layers.0.A_log"]
    assert g.scatters[-1].shape == (4,) and "model.layers.0.c" in g.sources  # the dry run went on after it
    assert validate_group(load_weights=load_named, params=params, group=g, metas=metas) == 3


def test_fallback_with_a_loader_that_reads_ahead_records_every_other_tensor() -> None:
    """A loader that takes ``list(weights)`` first has seen tensors it never ran when the refusal comes:
    the dry run starts over without the fallback tensor, so none of them is lost."""
    params = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)}

    def load(ws):
        for n, t in list(ws):
            key = n.rsplit(".", 1)[1]
            params[key].copy_(t * 2 if key == "b" else t)
    metas = [ParamMeta(name=f"model.layers.0.{k}", dtype="float32", shape=(2,)) for k in "abc"]
    plan = record_plan(metadata=metas, load_weights=load, params=params, allow_fallback=True)
    assert [f.src for f in plan.fallback] == ["model.layers.0.b"]
    assert {s.dst for s in plan.groups[0].scatters} >= {"a", "c"} and plan.unneeded == ()
