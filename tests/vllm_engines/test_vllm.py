"""Real vLLM (CPU build) with the shardsync backend, held to a FRESH engine: ``shardsync verify``.

Each case runs the CLI in a subprocess: one engine is synced with perturbed weights, a second one is
started on a checkpoint of the same weights, and every tensor after processing, the probe outputs of
every linear / LM-head kernel and the greedy tokens are compared.

The engines of these cases run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core in the CLI's
process, a TP1 worker too; TP2 workers are still spawned). What they test — vLLM's loaders recorded, the plan,
first-load processing replayed, bytes against a fresh engine — runs the same code either way, and a spawned engine
core costs a vLLM import per engine (a TP1 case: ~20 s in-process against ~75 s). The multi-process engine path a
user runs is covered by the trainer-API examples, the demo, the torn-engine and chaos tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardsync.verify import registration as plugin
from shardsync.testing.vllm import tiny_archs
from shardsync.verify.checkpoints import build_tiny_checkpoint, with_architecture
from shardsync.testing.vllm.fault_models import REPROCESS_FAILS

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")

    def build(arch: str) -> str:
        if arch in tiny_archs.FAMILIES:
            return tiny_archs.build(arch, str(root / arch))
        return build_tiny_checkpoint(arch, str(root / arch))
    return build


IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def verify(model_dir: str, *args: str, env: dict | None = None) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "shardsync.cli", "verify", model_dir, "--json", *args],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, **IN_PROCESS, **(env or {})})
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("{"), \
        f"--json must print exactly one JSON line; rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(lines[0]), proc.stdout + proc.stderr


# (family, tp, expert parallel, kinds whose vLLM reload must be reported as differing from a first load)
# Qwen3 TP2 against a fresh engine is covered by test_transfer_engine_into_two_real_vllm_replicas_tp2 below and
# test_trainer_api.py's FSDP2 example (both TP2 Qwen3, compared with fresh engines): not repeated here (CI time).
# Expert parallelism: per-expert checkpoint tensors (Qwen3-MoE; Qwen2-MoE loads its routed experts through the same
# FusedMoE expert_map path; its shared expert is a dense MLP, sharded alike with or without EP) and fused, transposed
# experts (Llama-4); Qwen2-MoE under EP is not repeated (CI time).
CASES = [
    ("qwen3_moe", 2, False, ("UnquantizedFusedMoEMethod",)),
    ("qwen3_moe", 2, True, ("UnquantizedFusedMoEMethod",)),
    ("qwen2", 2, False, ()),
    ("phi3", 2, False, ()),
    ("mixtral", 2, False, ("UnquantizedFusedMoEMethod",)),
    ("qwen2_moe", 2, False, ("UnquantizedFusedMoEMethod",)),
    ("llama4", 2, False, ("UnquantizedFusedMoEMethod",)),
    ("llama4", 2, True, ("UnquantizedFusedMoEMethod",)),
    ("deepseek", 1, False, ("UnquantizedFusedMoEMethod",)),
    ("gpt_oss", 1, False, ()),
    ("qwen3_tied", 2, False, ()),
    ("int8_w8a8", 1, False, ()),
    ("int8_w8a8_static", 1, False, ()),
    ("mamba2", 1, False, ()),
    ("falcon_h1", 1, False, ()),
]


@pytest.mark.parametrize("arch,tp,ep,differs", CASES, ids=[f"{a}-tp{t}{'-ep' if e else ''}" for a, t, e, _ in CASES])
def test_synced_engine_equals_a_fresh_engine(ckpts, arch: str, tp: int, ep: bool, differs: tuple) -> None:
    rc, r, log = verify(ckpts(arch), "--tp", str(tp), *(["--expert-parallel"] if ep else []))
    assert rc == 0 and r["exact"] is True, log[-6000:]
    assert r["reference"] == "fresh" and r["mismatched"] == [] and r["params_compared"] > 0
    assert r["weight_version"] == "1"
    assert all(v > 0 for v in r["validated_tensors_per_rank"])  # the init-time check ran against real loaders
    for kind in differs:  # the init-time processing check names the layer kinds vLLM's own reload gets wrong
        assert any(f"/{kind}[" in k and rep["vllm_reload_differs"] for k, rep in r["processing"].items()), \
            r["processing"]
    if arch == "qwen3_tied":  # the LM head shares the embedding: re-processed with it (its packed copy refreshed)
        assert r["tied"] == {"lm_head": {"weight": "model.embed_tokens.weight"}}, r["tied"]
        assert r["not_direct"]["tied to another module"] == ["model.embed_tokens"], r["not_direct"]
    # direct writes: every family has modules whose processing is the identity (norms at least), written straight
    # into the live tensors; CPU vLLM prepacks fused experts, so those stay on the general path (buffers + replay)
    assert all(n > 0 for n in r["direct_modules_per_rank"]), r["not_direct"]
    general = [m for ms in r["not_direct"].values() for m in ms]
    assert len(general) == r["general_modules_per_rank"][0] or len(general) >= 64 * len(r["not_direct"])
    if "UnquantizedFusedMoEMethod" in differs:
        assert any(".experts" in m for m in general), r["not_direct"]
    # vLLM's layerwise reload runs on the general modules, tied ones and attention layers only, not on every module
    reloaded, modules = r["reloaded_modules_per_rank"][0], r["modules_per_rank"][0]
    assert r["general_modules_per_rank"][0] <= reloaded < modules - r["direct_modules_per_rank"][0], (reloaded, modules)
    full = r["full_model_bytes"]
    if tp == 1:
        assert r["bytes_received_per_rank"][0] <= 1.01 * full  # the whole model, plus alignment padding
    else:  # each rank receives a share of the model (replicated norms / embeddings add a little)
        assert all(b < 0.75 * full for b in r["bytes_received_per_rank"]), r["bytes_received_per_rank"]
    if ep:  # no rank receives the other rank's experts
        e0, e1 = r["expert_ids_per_rank"]
        assert not (e0 and e1) or not set(e0) & set(e1)
        assert r["tokens_match"] is None  # vLLM's CPU MoE kernel cannot generate under EP
    else:
        assert r["tokens_match"] is True and r["tokens_changed_by_sync"] is True
        assert r["dry_run_unchanged"] is True  # recording and validating did not touch live weights


def test_general_path_alone_when_direct_writes_are_off(ckpts) -> None:
    """``direct_writes=False``: every module through vLLM's layerwise buffers and the first-load replay; the same
    bytes as a fresh engine (the path every kind the init check cannot prove takes)."""
    rc, r, log = verify(ckpts("qwen3"), "--no-direct")
    assert rc == 0 and r["exact"] is True and r["tokens_match"] is True, log[-6000:]
    assert r["direct_modules_per_rank"] == [0] and r["general_modules_per_rank"][0] > 0
    assert list(r["not_direct"]) == ["direct_writes=False"]
    assert r["general_modules_per_rank"][0] <= r["reloaded_modules_per_rank"][0] < r["modules_per_rank"][0]


def test_corrupted_byte_is_caught_by_the_fresh_reference(ckpts) -> None:
    rc, r, _ = verify(ckpts("qwen3"), "--self-test-corrupt")
    assert rc == 1 and r["exact"] is False and r["mismatched"]
    assert all(m.startswith(("rank0:t:model.layers.", "rank0:p:model.layers.")) for m in r["mismatched"]), \
        r["mismatched"]


def test_unrecordable_loader_takes_the_fallback_path(ckpts, tmp_path) -> None:
    """A loader that computes values (``w * 2``) cannot be replayed by the trainer: that tensor is sent
    whole and loaded by vLLM's real loader at sync time; the rest keeps the fast path."""
    bad = with_architecture(ckpts("qwen3"), str(tmp_path / "scaled-norm"), "ShardsyncScaledNormQwen3ForCausalLM")
    rc, r, log = verify(bad, env=plugin.env(models=True))  # the test models, registered in every vLLM process
    assert rc == 0 and r["exact"] is True and r["tokens_match"] is True, log[-4000:]
    (fb,) = r["fallback"]
    assert fb["src"] == "model.norm.weight" and fb["dests"] == ["model.norm.weight"] and fb["bytes"] > 0
    assert "unsupported op 'mul'" in fb["reason"]


def test_transfer_engine_into_two_real_vllm_replicas_tp2(tmp_path) -> None:
    """``demo --sync-only``: 2 producer processes (PP halves) -> 2 vLLM replicas x TP2 through the engine,
    every sync compared with a fresh engine on the same weights."""
    proc = subprocess.run([sys.executable, "-m", "shardsync.cli", "demo", "--sync-only", "--json", "--syncs", "2"],
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, **IN_PROCESS, "TMPDIR": str(tmp_path)})
    rows = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(rows) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in rows:
        assert r["exact"] and r["tensors_compared"] > 0
        assert len(r["bytes_per_consumer"]) == 4
        assert all(0.45 * r["full_model_bytes"] < b < 0.56 * r["full_model_bytes"] for b in r["bytes_per_consumer"])


UNWRITTEN = '''
import json, sys, threading
import torch
from safetensors.torch import load_file
from vllm import LLM
from shardsync import CoverageError, ModuleSource, Producer, ProducerConfig, ShardsyncError

if __name__ == "__main__":
    ckpt, mode, name = sys.argv[1], sys.argv[2], sys.argv[3]
    state = {k: v for k, v in load_file(ckpt + "/model.safetensors").items() if not (mode == "drop" and k == name)}
    if mode == "widen":  # the trainer's layer is wider than the engine's (its config differs)
        t = state[name]
        state[name] = torch.cat([t, t[: t.shape[0] // 2]])
    llm = LLM(model=ckpt, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.4,
              weight_transfer_config={"backend": "shardsync"})
    prod = Producer(ModuleSource(state), ProducerConfig(rank=0, n_producers=1, n_consumers=1, token="t" * 32,
                                                        init_timeout_s=60))
    errs = {}
    def engine():
        try:
            llm.init_weight_transfer_engine({"init_info": {"coordinator": list(prod.address), "token": "t" * 32}})
        except Exception as e:
            errs["engine"] = str(e)
    th = threading.Thread(target=engine); th.start()
    try:
        prod.init()
    except ShardsyncError as e:
        errs["producer"] = f"{type(e).__name__}: {e}"
    th.join(120)
    prod.close()
    from vllm import SamplingParams  # refused, not dead: the engine still serves its own weights
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0))
    errs["serves"] = list(out[0].outputs[0].token_ids)
    print(json.dumps(errs))
'''


@pytest.mark.parametrize("mode,name,says", [
    # left out of the trainer's tensors: its module would keep its old weights after every sync
    ("drop", "model.layers.1.mlp.down_proj.weight", "no trainer tensor writes"),
    # wider than the engine's: the loaders' narrow would load it cut to the engine's shape
    ("widen", "model.layers.0.mlp.up_proj.weight", "trainer [384, 256], engine [256, 256]"),
    # a layer whose processing fails when run again (the init-time processing check): refused, the engine still serves
    ("reprocess", "model.layers.0.mlp.down_proj", "processes its weights only once"),
])
def test_a_trainer_tensor_set_that_does_not_fit_the_engine_is_refused_at_init(ckpts, tmp_path, mode, name,
                                                                              says) -> None:
    """Either way the engine would report the new version while holding a model that exists nowhere: it refuses at
    init, naming the tensor (and both shapes), and the producer learns of it."""
    script = tmp_path / "unwritten.py"
    script.write_text(UNWRITTEN)
    ckpt, env = ckpts("qwen3"), {}
    if mode == "reprocess":
        ckpt, env = with_architecture(ckpt, str(tmp_path / mode), REPROCESS_FAILS), plugin.env(models=True)
    proc = subprocess.run([sys.executable, str(script), ckpt, mode, name], capture_output=True, text=True,
                          timeout=600,
                          env={**os.environ, **IN_PROCESS, **env, "VLLM_LOGGING_STREAM": "ext://sys.stderr"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    errs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert name in errs.get("engine", "") and says in errs["engine"], errs
    assert "producer" in errs, errs  # the producer's init fails too (within its bound), naming the engine's reason
    assert len(errs["serves"]) == 4, errs  # and the engine was refused, not killed: it still generates
