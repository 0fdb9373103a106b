"""How SkyRL picks the ``shardsync`` strategy by name, in every process it starts.

SkyRL 0.3.1 chooses its strategy with a two-way function (``skyrl_train.weight_sync.get_transfer_strategy_cls``:
CUDA IPC or broadcast), called in each trainer worker's constructor, inside Ray actors. :func:`enable_skyrl` wraps that
function so that ``generator.weight_sync_backend=shardsync`` returns :class:`ShardsyncTransferStrategy` (any other
value: SkyRL's own choice), here and, through Ray's ``worker_process_setup_hook``, in every Ray worker the job
starts. Call it in the driver before SkyRL initialises Ray. The inference side needs nothing: the init info is
pickled with its class, whose ``strategy_type()`` names the receiver.

SkyRL 0.3.1 pins ``ray==2.51.1``; newer Ray moved ``PlacementGroupSchedulingStrategy`` out of
``ray.util.placement_group``, where SkyRL imports it from. :func:`ray_compat` puts the name back (it is Ray's own
class), so that SkyRL imports beside the Ray the rest of the stack needs.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

__all__ = ["enable", "enable_skyrl", "ray_compat", "runtime_env_hook", "worker_setup"]

log = logging.getLogger(__name__)

HOOK_ENV = "RAY_RUNTIME_ENV_HOOK"
"""Ray reads this at ``ray.init``: a function that may change the job's runtime env."""
NEXT_HOOK_ENV = "SHARDSYNC_SKYRL_NEXT_RAY_HOOK"
"""A runtime-env hook that was set before :func:`enable_skyrl` (called after ours)."""
NEXT_SETUP_ENV = "SHARDSYNC_SKYRL_NEXT_SETUP"
"""A worker setup hook the job already had (called after ours, in every worker)."""
HOOK = f"{__name__}.runtime_env_hook"
SETUP = f"{__name__}.worker_setup"


def _load(path: str) -> Any:
    """The function a dotted path names (``package.module.function``)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def ray_compat() -> None:
    """``ray.util.placement_group.PlacementGroupSchedulingStrategy``, where SkyRL 0.3.1 imports it from."""
    import ray.util.placement_group  # noqa: F401  (the module; ``ray.util.placement_group`` is also a function)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    mod = sys.modules["ray.util.placement_group"]
    if not hasattr(mod, "PlacementGroupSchedulingStrategy"):
        mod.PlacementGroupSchedulingStrategy = PlacementGroupSchedulingStrategy


def _select() -> None:
    ray_compat()
    import skyrl_train.weight_sync as ws

    if getattr(ws.get_transfer_strategy_cls, "_shardsync", False):
        return
    from .strategy import BACKEND, ShardsyncTransferStrategy

    skyrl_choice = ws.get_transfer_strategy_cls

    def get_transfer_strategy_cls(cfg: Any) -> type:
        if cfg.generator.weight_sync_backend == BACKEND:
            return ShardsyncTransferStrategy
        return skyrl_choice(cfg)

    get_transfer_strategy_cls._shardsync = True  # type: ignore[attr-defined]
    get_transfer_strategy_cls.__doc__ = skyrl_choice.__doc__
    ws.get_transfer_strategy_cls = get_transfer_strategy_cls


def enable_skyrl() -> None:
    """``generator.weight_sync_backend=shardsync`` selects shardsync's strategy in this process and in every Ray
    worker of a job started after this call."""
    _select()
    import ray

    if ray.is_initialized():
        log.warning("shardsync.enable_skyrl() after ray.init(): Ray workers already started will not select the "
                    "shardsync strategy; call it before SkyRL initialises Ray")
    current = os.environ.get(HOOK_ENV)
    if current != HOOK:
        if current:
            os.environ[NEXT_HOOK_ENV] = current
        os.environ[HOOK_ENV] = HOOK


enable = enable_skyrl


def runtime_env_hook(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """Ray's runtime-env hook: every worker of the job runs :func:`worker_setup` first (a setup hook the job already
    had runs after it)."""
    nxt = os.environ.get(NEXT_HOOK_ENV)
    if nxt:
        runtime_env = _load(nxt)(runtime_env)
    env = dict(runtime_env or {})
    prior = env.get("worker_process_setup_hook")
    if prior == SETUP:
        return env
    if prior is not None and not isinstance(prior, str):
        raise TypeError("shardsync.enable_skyrl(): the job's worker_process_setup_hook is a callable; give it as a "
                        "module path so that shardsync's setup can run before it")
    env_vars = dict(env.get("env_vars") or {})
    if prior:
        env_vars[NEXT_SETUP_ENV] = prior
    env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = SETUP
    return env


def worker_setup() -> None:
    """In every Ray worker: select the strategy, then the job's own setup hook, if it had one."""
    try:
        import skyrl_train  # noqa: F401
    except ImportError:  # a worker of another kind (no SkyRL in its environment)
        return
    _select()
    nxt = os.environ.get(NEXT_SETUP_ENV)
    if nxt:
        _load(nxt)()


