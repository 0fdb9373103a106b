"""Real vLLM (CPU build) with the shardsync backend: ``shardsync verify`` on tiny random checkpoints.

Each case runs the CLI in a subprocess (one engine start each, ~25 s here) and reads its JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardsync.integrations.vllm.checkpoints import build_tiny_checkpoint, with_architecture

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return lambda arch: build_tiny_checkpoint(arch, str(root / arch))


def verify(model_dir: str, *args: str, env: dict | None = None) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "shardsync.cli", "verify", model_dir, "--json", *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON line; rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), proc.stdout + proc.stderr


CASES = [("qwen3", 1, False), ("qwen3", 2, False), ("qwen3_moe", 1, False), ("qwen3_moe", 2, False),
         ("qwen3_moe", 2, True), ("qwen2", 2, False), ("mixtral", 2, False), ("phi3", 2, False)]


@pytest.mark.parametrize("arch,tp,ep", CASES, ids=[f"{a}-tp{t}{'-ep' if e else ''}" for a, t, e in CASES])
def test_verify_is_bit_exact(ckpts, arch: str, tp: int, ep: bool) -> None:
    rc, r, log = verify(ckpts(arch), "--tp", str(tp), *(["--expert-parallel"] if ep else []))
    assert rc == 0 and r["exact"] is True, log[-4000:]
    assert r["mismatched"] == [] and r["params_compared"] > 0
    assert r["weight_version"] == "1"
    assert all(v > 0 for v in r["validated_tensors_per_rank"])  # the init-time check ran against real loaders
    full = r["full_model_bytes"]
    if tp == 1:
        assert r["bytes_received_per_rank"] == [r["payload_bytes_per_rank"][0]] and r["payload_bytes_per_rank"][0] <= full
    else:  # each rank receives about half the model's bytes (replicated norms add a little)
        assert all(0.45 * full <= b <= 0.56 * full for b in r["bytes_received_per_rank"]), r["bytes_received_per_rank"]
    if ep:  # no rank receives the other rank's experts
        e0, e1 = r["expert_ids_per_rank"]
        assert e0 and e1 and not set(e0) & set(e1) and sorted(e0 + e1) == list(range(8))
        assert r["tokens_match"] is None  # vLLM's CPU MoE kernel cannot generate under EP
    else:
        assert r["tokens_match"] is True and r["tokens_changed_by_sync"] is True
        assert r["dry_run_unchanged"] is True  # recording the plan did not touch live weights


def test_verify_detects_a_corrupted_byte(ckpts) -> None:
    rc, r, _ = verify(ckpts("qwen3"), "--self-test-corrupt")
    assert rc == 1 and r["exact"] is False and r["mismatched"]
    assert all(m.startswith("rank0:model.layers.") for m in r["mismatched"]), r["mismatched"]


def test_unsupported_loader_op_fails_init_with_its_name(ckpts, tmp_path) -> None:
    bad = with_architecture(ckpts("qwen3"), str(tmp_path / "scaled-norm"), "ShardsyncScaledNormQwen3ForCausalLM")
    rc, r, log = verify(bad, env={"SHARDSYNC_TEST_MODELS": "1"})
    assert rc == 1 and r["exact"] is False
    assert "unsupported op 'mul'" in r["error"] and "'model.norm.weight'" in r["error"], r["error"]
    assert r["unchanged_after_failed_init"] is True  # live weights restored after the failed dry run


def test_transfer_engine_into_two_real_vllm_replicas_tp2(tmp_path) -> None:
    """make demo's run: 2 producer processes (PP halves) -> 2 vLLM replicas x TP2 through the engine."""
    proc = subprocess.run([sys.executable, "-m", "shardsync.cli", "demo", "--json", "--syncs", "3"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and len(rows) == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in rows:
        assert r["exact"] and r["tensors_compared"] > 0
        assert len(r["bytes_per_consumer"]) == 4
        assert all(0.45 * r["full_model_bytes"] < b < 0.56 * r["full_model_bytes"] for b in r["bytes_per_consumer"])
