"""The test registration: what tests, ``shardsync verify`` and the other scaffolding add to vLLM, in every process
of an engine (the driver, the engine core, its workers, a vLLM server), through vLLM's own plugin entry points.

    enable()               # this process and those started after it: the testing engine as the shardsync backend
    enable(models=True)    # ... and the fault-injection test models (``models``)
    env(models=True)       # {"PYTHONPATH": ...} for a subprocess to start with (it then carries the same)

Each entry point is declared by a tiny ``*.dist-info`` directory (``METADATA``, ``entry_points.txt``) written to a
temporary directory that ``enable`` prepends to ``sys.path`` and ``PYTHONPATH``: vLLM's engine core and workers
(forked or spawned) and any process started with that environment find it through ``importlib.metadata`` as
they find an installed plugin (``vllm.general_plugins``), and call it before a model is built. Two entry points:

- ``shardsync_testing`` → ``register``: the ``shardsync`` backend becomes the testing engine (``verify_engine``:
  the product's pull mode plus inspection, driver push and the full baseline);
- ``shardsync_testing_models`` → ``shardsync.testing.vllm.fault_models.register``: the test models (test
  scaffolding, not in the wheel).

The product's plugin (``integrations/vllm/plugin.py``) knows nothing of either; an engine started without them is the product.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

__all__ = ["enable", "env", "register"]

GROUP = "vllm.general_plugins"
ENTRY_POINTS = {"backend": ("shardsync_testing", f"{__name__}:register"),
                "models": ("shardsync_testing_models", "shardsync.testing.vllm.fault_models:register")}

_dirs: dict[str, str] = {}


def register() -> None:
    """Entry point ``shardsync_testing``: the product plugin's registrations (idempotent), then the testing engine
    under the product's backend name, whichever of the two plugins vLLM calls first."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from ..integrations.vllm import plugin

    plugin.register()
    WeightTransferEngineFactory._registry[plugin.BACKEND] = _testing_engine


def _testing_engine():
    from .verify_engine import TestingEngine

    return TestingEngine


def _kinds(models: bool) -> list[str]:
    return ["backend", "models"] if models else ["backend"]


def _declared() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group=GROUP)}


def _plugin_dir(kind: str) -> str:
    """A directory holding one ``*.dist-info`` that declares ``kind``'s entry point (one per process, removed
    at its exit)."""
    if kind not in _dirs:
        name, target = ENTRY_POINTS[kind]
        root = tempfile.mkdtemp(prefix=f"{name}-")
        info = os.path.join(root, f"{name}-0.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
        with open(os.path.join(info, "entry_points.txt"), "w") as f:
            f.write(f"[{GROUP}]\n{name} = {target}\n")
        atexit.register(shutil.rmtree, root, True)
        _dirs[kind] = root
    return _dirs[kind]


def env(models: bool = False) -> dict[str, str]:
    """The environment variables (on top of ``os.environ``) a subprocess needs for its vLLM processes to carry the
    test registration: ``PYTHONPATH`` with the plugin directories first (none already declared here), and
    ``VLLM_PLUGINS`` where it is set (it then lists the plugins vLLM loads)."""
    declared = _declared()
    out: dict[str, str] = {}
    dirs = [_plugin_dir(k) for k in _kinds(models) if ENTRY_POINTS[k][0] not in declared]
    if dirs:
        out["PYTHONPATH"] = os.pathsep.join([*dirs, *filter(None, [os.environ.get("PYTHONPATH")])])
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None:
        names = [n for n in allowed.split(",") if n]
        out["VLLM_PLUGINS"] = ",".join(names + [ENTRY_POINTS[k][0] for k in _kinds(models)
                                                if ENTRY_POINTS[k][0] not in names])
    return out


def enable(models: bool = False) -> None:
    """The test registration for this process (now, even if vLLM loaded its plugins already) and for every process
    started after it (``sys.path`` for forked and spawned ones, ``PYTHONPATH`` for others)."""
    extra = env(models)
    for d in reversed(extra.get("PYTHONPATH", "").split(os.pathsep)):
        if d in _dirs.values() and d not in sys.path:
            sys.path.insert(0, d)
    os.environ.update(extra)
    register()
    if models:  # test scaffolding (``shardsync.testing``, not in the wheel): loaded the way vLLM loads it elsewhere
        from importlib.metadata import entry_points

        for ep in entry_points(group="vllm.general_plugins"):
            if ep.name == "shardsync_testing_models":
                ep.load()()
