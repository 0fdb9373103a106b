"""Where an engine's shardsync status files live: one predictable folder per engine start, removed when it stops.

Every worker writes ``plan_rank{R}.json``, ``init_rank{R}.json`` and ``status_rank{R}.json`` (``complete_version``,
``torn``, ``holds``, ...) to its ``plan_dir``. Where nobody names one (``ShardsyncTrainerInitInfo(status_dir=)`` on
the trainer, ``plan_dir`` in shardsync's own init info), the engine core assigns every worker of its engine the same
default before their init runs::

    {tempfile.gettempdir()}/shardsync-vllm/pid{P}      # e.g. /tmp/shardsync-vllm/pid41234/status_rank0.json

``P`` is the pid of the process that started the engine: the ``vllm serve`` process (``$!`` after starting it in
the background; vLLM's log lines start ``(APIServer pid=P)``), or your own process for an in-process ``LLM``. A
second engine of the same process (two ``LLM``s, data-parallel engine cores) gets ``pid{P}.2``, ``pid{P}.3``, ...:
each folder's ``engine.json`` names the engine core that claimed it. The root follows ``TMPDIR`` of the server.
A default folder lives as long as the process that started the engine: the status of the last sync stays readable
after a trainer disconnects (a torn engine's reason included), and the ``vllm serve`` process (or your process)
removes the folders named for it when it exits — not the workers: vLLM's server force-kills its engine core and
workers at a stop (``--shutdown-timeout 0``). A folder someone named is left in place. A server killed with SIGKILL
leaves its folder behind, and a later engine of a process with the same pid takes it over (its claimant is dead).

    path = claim_default_dir(driver_pid=os.getppid(), core_pid=os.getpid())   # the engine core, at each init
"""

from __future__ import annotations

import atexit
import glob
import json
import logging
import os
import shutil
import tempfile
from typing import Any

__all__ = ["ROOT_NAME", "default_root", "claim_default_dir", "remove_dir", "install"]

ROOT_NAME = "shardsync-vllm"
"""The default folders' parent, inside the server's temporary directory."""
OWNER_FILE = "engine.json"
_MARK = "_shardsync_status_dirs"
log = logging.getLogger("shardsync.status")


def default_root() -> str:
    return os.path.join(tempfile.gettempdir(), ROOT_NAME)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def claim_default_dir(*, driver_pid: int, core_pid: int, root: str | None = None) -> str:
    """The default folder of the engine core ``core_pid`` started by ``driver_pid``: ``pid{driver_pid}`` under the
    root, or the first ``pid{driver_pid}.N`` no other live engine core claimed (its ``engine.json``)."""
    root = root or default_root()
    os.makedirs(root, exist_ok=True)
    for n in range(1, 1000):
        path = os.path.join(root, f"pid{driver_pid}" + (f".{n}" if n > 1 else ""))
        owner_path = os.path.join(path, OWNER_FILE)
        os.makedirs(path, exist_ok=True)
        try:
            fd = os.open(owner_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(owner_path) as f:
                    owner = int(json.load(f)["engine_core_pid"])
            except (OSError, ValueError, KeyError, TypeError):
                owner = None
            if owner is not None and owner != core_pid and _alive(owner):
                continue  # another live engine of the same process
            fd = os.open(owner_path, os.O_WRONLY | os.O_TRUNC)  # ours already, or left by a dead engine
        with os.fdopen(fd, "w") as f:
            json.dump({"engine_core_pid": core_pid, "started_by_pid": driver_pid}, f)
        return path
    raise RuntimeError(f"no free status folder for pid {driver_pid} under {root}")


def remove_dir(path: str) -> None:
    """Remove a default status folder (best effort: the workers of one engine all try; the first one wins)."""
    shutil.rmtree(path, ignore_errors=True)


def remove_started_by(pid: int, root: str | None = None) -> list[str]:
    """Remove the default folders of the engines ``pid`` started (``pid{pid}``, ``pid{pid}.N``); returns them."""
    gone = []
    for path in glob.glob(os.path.join(root or default_root(), f"pid{pid}")) + \
            glob.glob(os.path.join(root or default_root(), f"pid{pid}.*")):
        remove_dir(path)
        gone.append(path)
    return gone


def _at_exit(pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the handler
        remove_started_by(pid)


# ---------------------------------------------------------------------------------------------- engine core
def _assign_default(core: Any, kwargs: Any) -> Any:
    """``kwargs`` of an ``init_weight_transfer_engine`` RPC with the engine's default folder filled in where a pull-mode
    init info (a coordinator) names none."""
    info = kwargs.get("init_info") if isinstance(kwargs, dict) else None
    if not isinstance(info, dict) or info.get("plan_dir") or info.get("inspect_to") or not info.get("coordinator"):
        return kwargs  # named, read-only, or a driver-push init (its driver reads the plans from the folder it names)
    from vllm.v1.engine.core import EngineCoreProc

    own_process = isinstance(core, EngineCoreProc)  # else the engine core runs inside the driver's process
    driver = os.getppid() if own_process else os.getpid()
    path = claim_default_dir(driver_pid=driver, core_pid=os.getpid())
    if getattr(core, _MARK, None) != path:
        log.info("shardsync: status files of this engine in %s (removed when it shuts down)", path)
        setattr(core, _MARK, path)
    return {**kwargs, "init_info": {**info, "plan_dir": path}}


def install() -> None:
    """Patch ``EngineCore.collective_rpc`` (once per process): an init of a shardsync engine that names no folder
    gets the engine's default one (the same for every worker of the engine). Every process that loads the plugin
    (the ``vllm serve`` process, a driver building an ``LLM``) removes the folders named for it when it exits."""
    from vllm.v1.engine.core import EngineCore

    if not getattr(install, "_at_exit", False):
        atexit.register(_at_exit, os.getpid())
        install._at_exit = True  # type: ignore[attr-defined]

    if getattr(EngineCore, "_shardsync_status_patch", False):
        return
    rpc = EngineCore.collective_rpc

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == "init_weight_transfer_engine":
            from .guard import serves_shardsync

            if serves_shardsync(self):
                try:
                    kwargs = _assign_default(self, kwargs)
                except Exception as e:  # the worker falls back to its own default folder
                    log.warning("shardsync: no default status folder: %s: %s", type(e).__name__, e)
        return rpc(self, method, timeout, args, kwargs)

    EngineCore.collective_rpc = collective_rpc
    EngineCore._shardsync_status_patch = True
