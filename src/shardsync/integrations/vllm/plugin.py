"""vLLM general plugin: registers the ``shardsync`` weight-transfer backend (once per process).

Note that the plugin does not import torch-heavy modules until vLLM instantiates the backend."""

from __future__ import annotations

BACKEND = "shardsync"


def register() -> None:
    import os

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if os.environ.get("SHARDSYNC_TEST_MODELS") == "1":  # fault-injection models for the test suite only
        from .testing_models import register as register_test_models

        register_test_models()
    if BACKEND in WeightTransferEngineFactory._registry:  # driver, engine core and workers all load plugins
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "shardsync.integrations.vllm.engine", "ShardsyncEngine")
