"""Swapped parameters never go stale (issue 35 item 5): a source follows the module it was built on.

Unit tests of ``ModuleSource`` / ``LiveTensors`` (``p.data = x``, ``module.weight = nn.Parameter(x)``, a submodule
replaced, a dict source losing a key, a shape or dtype change: a typed ``SourceChanged`` naming tensor, rank, expected
and found), ``ForeignSource``'s check, ``MegatronSource`` following its module, and a real ``Producer`` and
``Consumer`` over tcp: the swapped parameter's NEW bytes reach the engine; a shape change fails the sync on the trainer
side with the typed error while the engine keeps its previous version, not torn.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from shardsync.engine.producer.producer import Producer, ProducerConfig
from shardsync.errors import MetadataMismatch
from shardsync.source import ModuleSource, SourceChanged
from shardsync.sources.adapt import ForeignSource
from shardsync.testing.zoo import hf_state_dict

from test_wire import CFG, TOKEN, _catch, _close, _start, _Zoo


def _module_from(state: dict[str, torch.Tensor]) -> nn.Module:
    """An ``nn.Module`` tree whose ``state_dict`` names are ``state``'s (HF names), each tensor a Parameter."""
    root = nn.Module()
    for name, t in state.items():
        *path, attr = name.split(".")
        m = root
        for p in path:
            if p not in m._modules:
                m.add_module(p, nn.Module())
            m = m._modules[p]
        m.register_parameter(attr, nn.Parameter(t.clone()))
    return root


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return root.get_submodule(path), attr


def _pass(src: ModuleSource) -> dict[str, torch.Tensor]:
    return {n: t for names, ts in src.iter_groups() for n, t in zip(names, ts) if t is not None}


# ---- unit: ModuleSource follows the module -----------------------------------------------------------------------

def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))


def test_unchanged_and_in_place_updates_serve_the_same_objects() -> None:
    m = _tiny()
    src = ModuleSource(m)
    a = _pass(src)
    with torch.no_grad():
        m[0].weight.add_(1.0)  # an optimizer step: in place
    b = _pass(src)
    assert all(a[n] is b[n] for n in a)  # the producer's identity fast path keeps holding
    assert torch.equal(b["0.weight"], m[0].weight.detach()) and not b["0.weight"].requires_grad


def test_p_data_swap_is_followed() -> None:
    m = _tiny()
    src = ModuleSource(m)
    a = _pass(src)
    m[0].weight.data = torch.full((4, 3), 7.0)  # CPU offloading / some optimizers: the same Parameter, new storage
    b = _pass(src)
    assert b["0.weight"] is not a["0.weight"] and torch.equal(b["0.weight"], torch.full((4, 3), 7.0))
    assert b["0.weight"].data_ptr() == m[0].weight.data_ptr()
    assert b["0.bias"] is a["0.bias"]  # the others: the same objects as before
    m[0].weight.data = m[0].weight.data.t().contiguous().t()  # same shape, another layout
    c = _pass(src)
    assert c["0.weight"].stride() == m[0].weight.stride() and torch.equal(c["0.weight"], torch.full((4, 3), 7.0))


def test_a_new_parameter_object_and_a_replaced_submodule_are_followed() -> None:
    m = _tiny()
    src = ModuleSource(m)
    _pass(src)
    m[0].weight = nn.Parameter(torch.full((4, 3), 2.0))
    assert torch.equal(_pass(src)["0.weight"], torch.full((4, 3), 2.0))
    new = nn.LayerNorm(4)
    with torch.no_grad():
        new.weight.fill_(3.0)
    m[1] = new
    got = _pass(src)
    assert torch.equal(got["1.weight"], torch.full((4,), 3.0)) and got["1.weight"].data_ptr() == new.weight.data_ptr()


def test_a_buffer_swap_is_followed() -> None:
    m = nn.BatchNorm1d(4)
    src = ModuleSource(m)
    _pass(src)
    m.running_mean = torch.full((4,), 5.0)  # a buffer reassigned
    assert torch.equal(_pass(src)["running_mean"], torch.full((4,), 5.0))


@pytest.mark.parametrize("change, found", [
    (lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(5, 3))), "float32[5, 3]"),
    (lambda m: setattr(m[0].weight, "data", torch.zeros(4, 3, dtype=torch.float64)), "float64[4, 3]"),
    (lambda m: setattr(m[0].weight, "data", torch.zeros(4, 3, dtype=torch.float16)), "float16[4, 3]"),
    (lambda m: delattr(m[0], "weight"), "no parameter or buffer 'weight' of module '0'"),
])
def test_a_shape_dtype_or_presence_change_is_a_typed_error_naming_the_tensor(change, found: str) -> None:
    m = _tiny()
    src = ModuleSource(m, rank=3)
    _pass(src)
    change(m)
    with pytest.raises(SourceChanged) as e:
        next(iter(src.iter_groups()))  # before the first batch: nothing is gathered or sent
    err = e.value
    assert isinstance(err, MetadataMismatch)
    assert (err.tensor, err.rank, err.expected) == ("0.weight", 3, "float32[4, 3]") and found in err.found, err
    assert "'0.weight'" in str(err) and "trainer rank 3" in str(err) and "float32[4, 3]" in str(err)


def test_a_module_gone_from_the_tree_is_named() -> None:
    root = nn.Module()
    root.add_module("a", nn.Module())
    root.a.add_module("lin", nn.Linear(2, 2))
    src = ModuleSource(root)
    _pass(src)
    del root.a
    with pytest.raises(SourceChanged, match=r"'a.lin.weight'.*its module 'a.lin' is no longer part of the model"):
        _pass(src)


def test_a_dict_source_follows_its_mapping_and_names_a_dropped_key() -> None:
    sd = {"model.embed_tokens.weight": torch.zeros(4, 2), "model.layers.0.w": torch.ones(3)}
    src = ModuleSource(sd)
    a = _pass(src)
    assert a["model.layers.0.w"] is sd["model.layers.0.w"]
    sd["model.layers.0.w"] = torch.full((3,), 9.0)
    b = _pass(src)
    assert b["model.layers.0.w"] is sd["model.layers.0.w"] and b["model.embed_tokens.weight"] is a["model.embed_tokens.weight"]
    sd["model.layers.0.w"] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(SourceChanged, match=r"'model.layers.0.w'.*expected float32\[3\].*found bfloat16\[3\]"):
        _pass(src)
    sd["model.layers.0.w"] = torch.ones(3)
    _pass(src)
    t = sd["model.layers.0.w"]
    t.data = t.data.view(torch.int32)  # the same object over the same memory, another dtype
    with pytest.raises(SourceChanged, match=r"'model.layers.0.w'.*found int32\[3\]"):
        _pass(src)
    sd["model.layers.0.w"] = torch.ones(3)
    del sd["model.embed_tokens.weight"]
    with pytest.raises(SourceChanged, match=r"'model.embed_tokens.weight'.*no key of that name"):
        _pass(src)


def test_held_names_only_are_looked_up() -> None:
    sd = {"model.layers.0.a": torch.zeros(2), "model.layers.1.a": torch.ones(2)}
    src = ModuleSource(sd, held=["model.layers.1.a"])
    del sd["model.layers.0.a"]  # not this rank's: never asked for
    got = [(ns, ts) for ns, ts in src.iter_groups()]
    assert got == [(["model.layers.1.a"], [sd["model.layers.1.a"]])]


def test_foreign_source_checks_what_the_wrapped_source_yields() -> None:
    class Inner:  # vLLM's interface, duck-typed
        def __init__(self) -> None:
            self.t = torch.zeros(2, 2)

        def metadata(self):
            from shardsync.types import ParamMeta
            return [ParamMeta(name="model.layers.0.w", dtype="float32", shape=(2, 2))]

        def held_names(self):
            return None

        def groups(self):
            return [["model.layers.0.w"]]

        def iter_groups(self):
            yield ["model.layers.0.w"], [self.t]

    inner = Inner()
    src = ForeignSource(inner)
    assert _pass(src)["model.layers.0.w"] is inner.t  # type: ignore[arg-type]
    inner.t = torch.zeros(3, 2)
    with pytest.raises(SourceChanged, match=r"'model.layers.0.w'.*expected float32\[2, 2\].*found float32\[3, 2\]"):
        _pass(src)  # type: ignore[arg-type]


# ---- end to end: a real Producer and Consumer over tcp ------------------------------------------------------------

def _swap_to(root: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Version v's weights into ``root`` three ways: ``p.data = x``, a new Parameter, in place."""
    for i, (n, t) in enumerate(state.items()):
        m, attr = _owner(root, n)
        if i % 3 == 0:
            m._parameters[attr].data = t.clone()
        elif i % 3 == 1:
            setattr(m, attr, nn.Parameter(t.clone()))
        else:
            with torch.no_grad():
                m._parameters[attr].copy_(t)


def _sync(p: Producer, z: _Zoo, v: int) -> tuple[Any, list]:
    errs: list = []
    th = threading.Thread(target=_catch, args=(lambda: z.c.sync(v), errs), daemon=True)
    th.start()
    out: Any = None
    try:
        out = p.sync(v)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        out = e
    th.join(30)
    assert not th.is_alive()
    return out, errs


def test_swapped_parameters_reach_the_engine_and_a_shape_change_fails_typed_leaving_it_whole() -> None:
    root = _module_from(hf_state_dict(CFG, seed=0))
    p = Producer(ModuleSource(root, rank=0), ProducerConfig(rank=0, n_producers=1, n_consumers=1, token=TOKEN,
                                                            max_chunk_bytes=32 << 10, lease_s=2.0, timeout_s=10.0,
                                                            init_timeout_s=30.0))
    err: list = []
    th = threading.Thread(target=lambda: _catch(p.init, err), daemon=True)
    th.start()
    z = _Zoo(p.address, "r0/tp0")
    try:
        _start([z])
        th.join(30)
        assert not err, err
        for v in (1, 2, 3):
            _swap_to(root, hf_state_dict(CFG, seed=v))
            stats, errs = _sync(p, z, v)
            assert isinstance(stats, dict) and not errs, (stats, errs)
            assert z.c.version == v and not z.mismatched(hf_state_dict(CFG, seed=v)), v  # the NEW bytes, exactly
        live = dict(z.live.state_dict())
        name = "model.layers.1.self_attn.q_proj.weight"
        want = hf_state_dict(CFG, seed=3)[name]
        m, attr = _owner(root, name)
        assert m._parameters[attr].detach().view(torch.uint8).equal(want.view(torch.uint8))
        # a shape change after init: the trainer's sync fails with the typed error naming it; the engine stays whole
        setattr(m, attr, nn.Parameter(torch.zeros(want.shape[0] + 1, *want.shape[1:], dtype=want.dtype)))
        out, errs = _sync(p, z, 4)
        assert isinstance(out, SourceChanged), out
        assert out.tensor == name and out.rank == 0 and out.expected.endswith(str(list(want.shape))), out
        assert errs, "the engine's sync must fail too"
        assert z.c.version == 3 and not z.c.torn
        assert not z.mismatched(hf_state_dict(CFG, seed=3))
        assert all(torch.equal(t, live[k]) for k, t in z.live.state_dict().items())
    finally:
        _close(p, [z])


def test_megatron_source_follows_its_local_state() -> None:
    from shardsync.sources.megatron import MegatronConfig, MegatronParallel, MegatronSource, hf_to_megatron_shards

    cfg = MegatronConfig(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, head_dim=8, inter=32, dtype="float32",
                         make_vocab_size_divisible_by=8)
    par = MegatronParallel(tp=1, pp=1, tp_rank=0, pp_rank=0)
    local = hf_to_megatron_shards({k: v.float() for k, v in _hf(cfg).items()}, cfg, par)
    src = MegatronSource(local, cfg, par, tp_group=None)
    a = _pass(src)  # type: ignore[arg-type]
    name = next(n for n in local if n.endswith("linear_proj.weight"))
    local[name] = torch.full_like(local[name], 4.0)
    b = _pass(src)  # type: ignore[arg-type]
    changed = [n for n in b if not torch.equal(a[n], b[n])]
    assert changed == ["model.layers.0.self_attn.o_proj.weight"] and bool((b[changed[0]] == 4.0).all())
    local[name] = torch.zeros(3)
    with pytest.raises(SourceChanged, match=rf"'{name}'.*found float32\[3\]"):
        _pass(src)  # type: ignore[arg-type]


def _hf(cfg: Any) -> dict[str, torch.Tensor]:
    from shardsync.sources.megatron_layout import hf_shapes

    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(*s, generator=g) for n, s in hf_shapes(cfg).items()}
