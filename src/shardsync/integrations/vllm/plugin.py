"""vLLM general plugin: registers the ``shardsync`` weight-transfer backend (once per process) and
records each module's first-load state when vLLM builds a model (``fresh.install_snapshot_hook``), and installs
the engine core's torn-weights guard (``guard.install``), the engine's default status folder (``status.install``)
and, in vLLM's OpenAI server, the torn reason in refused requests' responses (``serving.install``).

It runs in every vLLM process of every engine in an environment where shardsync is installed, so it never breaks
one: each step is skipped (and logged) where its target is missing in this vLLM, the hooks act only in engines
started with ``weight_transfer_config={"backend": "shardsync"}``, and a shardsync worker engine refuses to start
in a process where a step it needs failed (``require_plugin``), naming it."""

from __future__ import annotations

import logging

from .selection import BACKEND, selects_shardsync  # noqa: F401  (re-exported: the plugin's public names)

FAILED: dict[str, str] = {}
"""Plugin steps that failed in this process: step name -> error (read by :func:`require_plugin`)."""
log = logging.getLogger("shardsync.plugin")


def register() -> None:
    for step in (_request_amx, _install_snapshot_hook, _install_torn_guard, register_trainer, _register_worker):
        try:
            step()
        except Exception as e:  # never break an engine that may not even use shardsync
            FAILED[step.__name__] = f"{type(e).__name__}: {e}"
            log.warning("shardsync plugin: %s skipped: %s", step.__name__.lstrip("_"), FAILED[step.__name__])
    for step in (_install_status_dirs, _install_server_errors):  # conveniences: an engine starts without them
        try:
            step()
        except Exception as e:
            log.warning("shardsync plugin: %s skipped: %s: %s", step.__name__.lstrip("_"), type(e).__name__, e)


def require_plugin() -> None:
    """Raise, naming the vLLM version, if a plugin step a shardsync engine needs failed in this process."""
    if FAILED:
        from ...errors import ShardsyncError
        from .compat import vllm_version

        raise ShardsyncError(f"shardsync's vLLM plugin could not install {sorted(FAILED)} on vLLM "
                             f"{'.'.join(map(str, vllm_version()))}: {FAILED}")


def _install_snapshot_hook() -> None:
    from .first_load import install_snapshot_hook

    install_snapshot_hook()  # every process that may build a model: record each module's first-load state


def _install_torn_guard() -> None:
    from .guard import install

    install()  # every engine core: a torn engine (last sync incomplete) serves nothing


def _install_status_dirs() -> None:
    from .status import install

    install()  # every engine core: one predictable status folder per engine, removed at shutdown


def _install_server_errors() -> None:
    from .serving import install

    install()  # vLLM's API server process only: a torn engine's refusal answered with its reason, not "Internal ..."


def _register_worker() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # driver, engine core and workers all load plugins
        WeightTransferEngineFactory.register_engine(BACKEND, "shardsync.integrations.vllm.worker_backend", "ShardsyncEngine")


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
