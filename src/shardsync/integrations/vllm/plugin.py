"""vLLM general plugin: registers the ``shardsync`` weight-transfer backend (once per process)."""

from __future__ import annotations

BACKEND = "shardsync"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND in WeightTransferEngineFactory._registry:  # driver, engine core and workers all load plugins
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "shardsync.integrations.vllm.engine", "ShardsyncEngine")
