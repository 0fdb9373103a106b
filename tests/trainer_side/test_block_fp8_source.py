"""A bf16 trainer into a block-FP8 engine: ``BlockFP8Source`` serves each weight the engine's checkpoint stores as
FP8 as its FP8 bytes and ``weight_scale_inv``, quantised on the trainer by the function the checkpoint was made with,
so what an engine loads from it equals, byte for byte, what it loads from that checkpoint (the real-vLLM case runs on
the GPU: tests/gpu/test_gpu_vllm.py, ``--checkpoint fp8-block --trainer bf16``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from helpers import raw
from shardsync import BlockFP8Source, MetadataMismatch, ModuleSource
from shardsync.engine.inprocess import LocalConsumer, loopback_sync
from shardsync.kernels.fp8 import FP8_MAX, block_fp8
from shardsync.plan.record import record_plan
from shardsync.sources.quantize import block_fp8_names
from shardsync.types import ParamMeta
from shardsync.verify.checkpoints import load_checkpoint, to_block_fp8


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * torch.linspace(0.01, 2, s[-1])).to(torch.bfloat16)  # noqa: E731
    return {"model.embed_tokens.weight": r(64, 256),
            "model.layers.0.mlp.gate_proj.weight": r(320, 256),    # 320 rows: a partial edge tile
            "model.layers.0.mlp.up_proj.weight": r(320, 256),
            "model.layers.0.mlp.down_proj.weight": r(256, 320),
            "model.layers.0.mlp.gate.weight": r(8, 256),           # a router: stays bf16
            "model.layers.0.input_layernorm.weight": r(256)}


def test_block_fp8_tiles_scales_and_partial_edges() -> None:
    w = _weights()["model.layers.0.mlp.down_proj.weight"]       # 256 x 320: the last column tile is 64 wide
    q, s = block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (2, 3) and s.dtype == torch.float32
    x = w.float()
    for i in range(2):
        for j in range(3):
            tile = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j] == tile.abs().amax() / FP8_MAX            # partial tiles: the amax of what they hold
            deq = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float() * s[i, j]
            assert (deq - tile).norm() / tile.norm() < 0.05
    with pytest.raises(ValueError, match="2-D"):
        block_fp8(torch.zeros(4))


def _checkpoint(tmp_path, weights) -> str:
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(weights, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    return to_block_fp8(str(d))


def test_names_and_block_come_from_the_checkpoint(tmp_path) -> None:
    ckpt = _checkpoint(tmp_path, _weights())
    names, block = block_fp8_names(ckpt)
    assert block == (128, 128)
    assert sorted(names) == sorted(f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a block-FP8 checkpoint"):
        block_fp8_names(str(plain))


def _engine_plan(metas: list[ParamMeta]):
    """An engine that fuses gate and up (weights and scales stacked by rows, as vLLM's merged column linear does)
    and keeps every other checkpoint tensor as it is."""
    by = {m.name: m for m in metas}
    dt = lambda m: getattr(torch, m.dtype)  # noqa: E731
    fused = {"gate_up.weight": ("weight", 640), "gate_up.weight_scale_inv": ("weight_scale_inv", 6)}
    params = {k: torch.zeros((rows, *by[f"model.layers.0.mlp.gate_proj.{suf}"].shape[1:]),
                             dtype=dt(by[f"model.layers.0.mlp.gate_proj.{suf}"])) for k, (suf, rows) in fused.items()}
    for m in metas:
        if ".gate_proj." not in m.name and ".up_proj." not in m.name:
            params[m.name] = torch.zeros(m.shape, dtype=dt(m))

    def load(ws):
        for n, t in ws:
            for proj, half in (("gate_proj", 0), ("up_proj", 1)):
                if f".{proj}." in n:
                    suf = n.rsplit(".", 1)[1]
                    dst = params[f"gate_up.{suf}"]
                    dst.narrow(0, half * dst.shape[0] // 2, dst.shape[0] // 2).copy_(t)
                    break
            else:
                params[n].copy_(t)
        return list(params)

    return record_plan(metadata=metas, load_weights=load, params=params), params


def test_a_bf16_trainer_syncs_what_the_engine_loads_from_its_fp8_checkpoint(tmp_path) -> None:
    bf16 = _weights()
    ckpt = _checkpoint(tmp_path, dict(bf16))
    on_disk = load_checkpoint(ckpt)
    src = BlockFP8Source.for_checkpoint(ModuleSource(_weights()), ckpt)
    metas = src.metadata()
    # the source's metadata is the checkpoint's: names, dtypes and shapes (scales right after their weight)
    assert {m.name: (m.dtype, tuple(m.shape)) for m in metas} == \
        {k: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in on_disk.items()}
    i = [m.name for m in metas].index("model.layers.0.mlp.down_proj.weight")
    assert metas[i + 1].name == "model.layers.0.mlp.down_proj.weight_scale_inv"
    assert all(n + "_scale_inv" in g for g in src.groups() for n in g if n.endswith("proj.weight"))
    plan, _ = _engine_plan(metas)
    reference = _engine_plan(metas)[1]                 # what the engine loads from the checkpoint itself
    plan.verify_digest()
    for n, t in on_disk.items():
        dst = reference["gate_up." + n.rsplit(".", 1)[1]] if (".gate_proj." in n or ".up_proj." in n) else reference[n]
        if ".gate_proj." in n or ".up_proj." in n:
            half = 0 if ".gate_proj." in n else 1
            dst = dst.narrow(0, half * dst.shape[0] // 2, dst.shape[0] // 2)
        dst.copy_(t)
    live = {k: torch.full_like(v, 3) for k, v in reference.items()}
    loopback_sync(src, [LocalConsumer(plan, live)], version=1)
    for k in reference:
        assert torch.equal(raw(live[k]), raw(reference[k])), k
    # the next step: new bf16 weights, quantised afresh on the trainer
    for t in src.inner.gather([n for n in bf16]).values():
        t.mul_(1.5)
    loopback_sync(src, [LocalConsumer(plan, live)], version=2)
    q, s = block_fp8(bf16["model.layers.0.mlp.down_proj.weight"] * 1.5)
    assert torch.equal(raw(live["model.layers.0.mlp.down_proj.weight"]), raw(q))
    assert torch.equal(live["model.layers.0.mlp.down_proj.weight_scale_inv"], s)


def test_what_cannot_be_block_quantised_is_refused_by_name() -> None:
    w = _weights()
    with pytest.raises(MetadataMismatch, match="not in the trainer's metadata.*nope"):
        BlockFP8Source(ModuleSource(w), ["nope.weight"]).metadata()
    with pytest.raises(MetadataMismatch, match="input_layernorm.weight.*2-D"):
        BlockFP8Source(ModuleSource(w), ["model.layers.0.input_layernorm.weight"]).metadata()
    q = dict(w, **{"x.weight": torch.zeros(128, 128, dtype=torch.float8_e4m3fn)})
    with pytest.raises(MetadataMismatch, match="x.weight.*2-D bf16"):
        BlockFP8Source(ModuleSource(q), ["x.weight"]).metadata()
    s = dict(w, **{"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(3, 2)})
    with pytest.raises(MetadataMismatch, match="already holds"):
        BlockFP8Source(ModuleSource(s), ["model.layers.0.mlp.up_proj.weight"]).metadata()
    with pytest.raises(ValueError, match="block must be positive"):
        BlockFP8Source(ModuleSource(w), [], block=(0, 128))


def test_held_names_gain_their_scales() -> None:
    class Stage(ModuleSource):
        def held_names(self):
            return ["model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"]

    src = BlockFP8Source(Stage(_weights()), ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"])
    assert list(src.held_names()) == ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv",
                                      "model.layers.0.input_layernorm.weight"]
