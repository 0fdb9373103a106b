"""TRL's own ``GRPOTrainer`` on CPU with a tiny Llama, its colocated vLLM engine synced by shardsync
(``shardsync.enable_trl()``): after every sync the engine equals a fresh load of the trainer's weights
byte for byte (``check_fresh``) and generates the greedy tokens a FRESH engine, started on those weights with the
synced engine's arguments, generates; the loss curve equals that of the same run synced by vLLM's own in-place reload
(TRL's own ``load_weights`` loop does not run on CPU vLLM 0.32: its CPU linear layers drop ``weight_loader``). With a
LoRA adapter (TRL merges, syncs, unmerges) the same holds. Each run is a process of its own (``trl_run.py``: TRL's
``LLM`` initialises torch.distributed in-process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.procs]
RUN = os.path.join(os.path.dirname(__file__), "trl_run.py")


def _run(tmp_path, name: str, *args: str) -> dict:
    work = tmp_path / name
    work.mkdir()
    out = work / "out.json"
    p = subprocess.run([sys.executable, RUN, "--work", str(work), "--out", str(out), *args], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0 and out.exists(), p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(out.read_text())


def _exact_every_sync(r: dict, steps: int) -> None:
    assert r["class"] == "ShardsyncVLLMGeneration", r["class"]
    assert len(r["syncs"]) == steps, len(r["syncs"])
    for k, s in enumerate(r["syncs"]):
        f = s["fresh"]
        assert f.get("error") is None and f["compared"] >= 20 and f["n_mismatched"] == 0, (k, f)
        st = s["stats"]
        assert st["version"] == k + 1 and st["bytes_sent"] > 0 and not st.get("dropped"), (k, st)
    digests = [s["fresh"]["digest"] for s in r["syncs"]]
    assert len(set(digests)) == len(digests), "the weights changed every step"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_trainer_synced_by_shardsync_is_exact_and_trains_as_vllms_reload(tmp_path, lora: bool) -> None:
    extra = ["--lora"] if lora else []
    ours = _run(tmp_path, "shardsync", "--sync", "shardsync", *extra)
    _exact_every_sync(ours, 3)
    fresh = _run(tmp_path, "fresh", "--engine", "colocate", "--fresh", *[s["checkpoint"] for s in ours["syncs"]])
    assert [s["tokens"] for s in ours["syncs"]] == fresh["tokens"]
    theirs = _run(tmp_path, "reload", "--sync", "reload", *extra)
    assert len(ours["losses"]) == 3 and ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    assert [s["tokens"] for s in theirs["syncs"]] == [s["tokens"] for s in ours["syncs"]]


def test_grpo_trainer_in_server_mode_syncs_a_vllm_server_exactly(tmp_path) -> None:
    """``vllm_mode="server"``: TRL generates through its client against ``vllm serve`` with the shardsync backend
    (TRL's NCCL communicator is not set up); the trainer syncs it over the server's weight-transfer routes, exact
    every sync, with a fresh engine's greedy tokens."""
    sys.path.insert(0, os.path.dirname(__file__))
    from trl_run import tiny_model

    from shardsync.testing.vllm.vllm_server import VllmServer

    model = tiny_model(str(tmp_path / "model"))
    srv = VllmServer(model, tmpdir=str(tmp_path / "srv"), args=("--logprobs-mode", "processed_logprobs",
                                                                   "--max-logprobs", "-1"))
    srv.start()
    try:
        ours = _run(tmp_path, "server", "--sync", "shardsync", "--server", srv.url, "--model", model)
    finally:
        srv.stop()
    _exact_every_sync(ours, 3)
    fresh = _run(tmp_path, "fresh", "--engine", "server", "--fresh", *[s["checkpoint"] for s in ours["syncs"]])
    assert [s["tokens"] for s in ours["syncs"]] == fresh["tokens"]
    assert srv.leftover == [], srv.leftover


def test_the_trl_example_runs_as_written(tmp_path) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from trl_run import tiny_model

    model = tiny_model(str(tmp_path / "model"))
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "trl_grpo.py")
    p = subprocess.run([sys.executable, example, model], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "last sync: {'version': 3" in p.stdout, p.stdout[-2000:]
