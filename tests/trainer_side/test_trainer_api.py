"""The trainer side as users adopt it: the three examples (run as users run them, checked byte for byte
against a FRESH vLLM engine on the trainer's final weights), vLLM's trainer API with the shardsync init info
as a drop-in for the nccl one, and the source adapter both ways."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> dict:
    """The example with the test registration in its vLLM processes: its ``--verify`` inspects its engine."""
    from shardsync.verify import registration as plugin

    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args, "--json"], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **plugin.env()})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[0])  # --json: stdout is the JSON line and nothing else


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["llm-non-blocking", "http"])
def test_vllm_trainer_api_example_into_a_real_engine_is_exact(mode: str) -> None:
    """Through vLLM's own clients: the in-process ``LLM`` (non-blocking sends; the blocking path runs in the FSDP2
    example) and ``HTTPVLLMWeightSyncClient`` against a vLLM server."""
    steps = 3 if mode.startswith("llm") else 2
    r = run_example("vllm_trainer_api.py", "--steps", str(steps), "--verify", "--client", mode.split("-")[0],
                    *(["--async-sync"] if mode.endswith("non-blocking") else []))
    assert r["exact"] is True and r["tensors_compared"] > 0 and r["mismatched"] == []
    assert r["versions"] == [str(v) for v in range(1, steps + 1)]
    assert r["tokens"] == r["fresh_tokens"]
    assert r["engine_workers"] == 1  # the trainer could check world_size (=2) against the engine: LLM or HTTP server


@pytest.mark.vllm
def test_fsdp2_trainer_two_ranks_into_vllm_tp2_is_exact_with_one_gather_per_group() -> None:
    r = run_example("fsdp2.py", "--steps", "3", "--verify")
    assert r["exact"] is True and r["ranks"][0]["tensors_compared"] > 0
    for rank in r["ranks"]:
        per_sync = [s["collectives"] for s in rank["syncs"]]
        groups = rank["syncs"][0]["gather_batches"]
        # lockstep: every rank gathers every group once per sync, with one collective per group, and no more
        assert per_sync == [groups * (i + 1) for i in range(3)], per_sync
        assert all(s["bytes_sent"] > 0 for s in rank["syncs"])  # both ranks serve part of every sync
    losses = [s["loss"] for s in r["ranks"][0]["syncs"]]
    assert losses == [s["loss"] for s in r["ranks"][1]["syncs"]]  # one model, trained in step


@pytest.mark.vllm
def test_fsdp2_module_under_vllms_own_module_source_is_accepted_unchanged() -> None:
    r = run_example("fsdp2.py", "--steps", "2", "--source", "vllm", "--verify")
    assert r["exact"] is True and r["ranks"][0]["tensors_compared"] > 0


@pytest.mark.vllm
def test_plain_module_example_with_shardsyncs_own_api_is_exact() -> None:
    r = run_example("plain_module.py", "--steps", "2", "--verify")
    assert r["exact"] is True and r["tensors_compared"] > 0 and r["version"] == "2"


def test_init_info_is_a_drop_in_for_vllms_nccl_init_info() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerEngine, ShardsyncTrainerInitInfo

    kw = dict(master_address="10.0.0.1", master_port=29600, world_size=9, rank=3)
    nccl, ours = NCCLTrainerInitInfo(**kw), ShardsyncTrainerInitInfo(**kw)  # the same call, another class
    for k, v in kw.items():
        assert getattr(nccl, k) == getattr(ours, k) == v
    nccl_fields = {f.name for f in dataclasses.fields(NCCLTrainerInitInfo)}
    assert nccl_fields <= {f.name for f in dataclasses.fields(ShardsyncTrainerInitInfo)}
    assert ours.backend == "shardsync" and WeightTransferTrainerFactory._registry["shardsync"]() is \
        ShardsyncTrainerEngine
    with pytest.raises(ValueError, match="world_size"):
        WeightTransferTrainerFactory.trainer_init(ShardsyncTrainerInitInfo(world_size=1, rank=0), client=object(),
                                                  source=object())


def _tiny_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.1.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"]
    return {n: torch.randn(4, 3, generator=g).to(torch.bfloat16) for n in names}


def test_source_adapter_both_ways_yields_the_same_batches() -> None:
    from vllm.distributed.weight_transfer.base import WeightSource as VllmWeightSource

    from shardsync.integrations.vllm.vllm_source import as_vllm_source
    from shardsync.source import ModuleSource
    from shardsync.sources import adapt

    state = _tiny_state()
    ours = ModuleSource(state, held=[n for n in state if "layers.1" not in n])
    theirs = as_vllm_source(ours)
    assert isinstance(theirs, VllmWeightSource) and adapt(theirs) is ours  # unwrapped, never double-wrapped
    assert [(m.name, m.dtype, m.shape) for m in theirs.metadata()] == \
        [(m.name, torch.bfloat16, tuple(m.shape)) for m in ours.metadata()]
    # vLLM's own default batching over our iteration agrees with our iter_groups (order checks included)
    via_vllm = list(VllmWeightSource.iter_groups(theirs))
    native = list(ours.iter_groups())
    assert [n for n, _ in via_vllm] == [n for n, _ in native] and len(native) == 3  # layer 1 not held: skipped
    for (_, a), (_, b) in zip(via_vllm, native):
        assert all(x.equal(y) for x, y in zip(a, b))

    class VllmStyle(VllmWeightSource):  # a vLLM-interface source (torch dtypes) seen through the adapter
        def metadata(self):
            from vllm.distributed.weight_transfer.base import ParamMeta
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in state.items()]

        def __iter__(self):
            yield from state.items()

    back = adapt(VllmStyle())
    assert [m.dtype for m in back.metadata()] == ["bfloat16"] * len(state)
    got = {n: t for names, ts in back.iter_groups() for n, t in zip(names, ts)}
    assert got.keys() == state.keys() and all(got[n].equal(state[n]) for n in state)
