"""vLLM general plugin: registers the ``shardsync`` weight-transfer backend (once per process) and
records each module's first-load state when vLLM builds a model (``fresh.install_snapshot_hook``), and installs
the engine core's torn-weights guard (``guard.install``)."""

from __future__ import annotations

BACKEND = "shardsync"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from .fresh import install_snapshot_hook

    _request_amx()
    install_snapshot_hook()  # every process that may build a model: record each module's first-load state
    from .guard import install as install_torn_guard

    install_torn_guard()  # every engine core: a torn engine (last sync incomplete) serves nothing
    register_trainer()
    if BACKEND in WeightTransferEngineFactory._registry:  # driver, engine core and workers all load plugins
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "shardsync.integrations.vllm.engine", "ShardsyncEngine")


def _request_amx() -> None:
    """Ask Linux for permission to use AMX tiles in this process (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, through
    torch) where the CPU has them. Without it the first AMX instruction raises SIGILL; vLLM 0.32's CPU attention
    kernel can reach one before anything else in the worker has asked (seen here: workers dying with exit code
    -4 in ``cpu_attention_with_kv_cache`` in about half of the starts of a tiny model; none in runs with this)."""
    try:
        import torch

        if torch.cpu._is_amx_tile_supported():
            torch._C._cpu._init_amx()
    except Exception:  # not x86, an older torch: nothing to ask for
        pass


def register_trainer() -> None:
    """The trainer-side backend (``WeightTransferTrainerFactory``), once per process; also run on importing
    ``trainer_backend``, so a trainer that never built an ``LLM`` (HTTP / Ray clients) finds it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "shardsync.integrations.vllm.trainer_backend",
                                                     "ShardsyncTrainerEngine")
