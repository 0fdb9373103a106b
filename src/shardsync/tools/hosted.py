"""An object living in a child process of its own process group: call its methods, kill it as a whole.

    h = Hosted("r0", "shardsync.tools.harness.vllm_engine:VllmEngine", kwargs)   # constructs it in a new process
    h.ready(timeout=600)                      # waits until the constructor returned (or raises its error)
    call = h.call("generate", prompts)        # sends the call; the child runs calls one at a time, in order
    tokens = call.result(timeout=60)          # its return value, or the child's exception as HostedError
    h.kill()                                  # SIGKILL to the whole group (a vLLM engine's core and workers too)

Every wait has a deadline and names what it waited for; a child that dies makes every pending call fail
with :class:`HostedDied` at once (no wait runs to its deadline for a dead child).
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any

__all__ = ["Hosted", "HostedError", "HostedDied", "Call"]

_CTX = mp.get_context("spawn")


class HostedError(RuntimeError):
    """The hosted object raised: the child's exception type, message and traceback tail."""


class HostedDied(RuntimeError):
    """The child process is gone (killed or crashed) before it answered."""


def _load(path: str) -> Any:
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def _main(name: str, cls_path: str, kwargs: dict, cmd: Any, out: Any) -> None:
    os.setpgrp()  # one group: kill() takes whatever this process starts (vLLM's engine core, its workers)
    try:
        obj = _load(cls_path)(**kwargs)
    except BaseException as e:
        out.send((0, "error", f"{name}: constructing {cls_path}: {type(e).__name__}: {e}\n"
                              f"{traceback.format_exc()[-2000:]}"))
        return
    out.send((0, "ok", None))
    while (msg := cmd.get()) is not None:
        cid, method, args, kw = msg
        try:
            out.send((cid, "ok", getattr(obj, method)(*args, **kw)))
        except BaseException as e:
            out.send((cid, "error", f"{name}.{method}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
    close = getattr(obj, "close", None)
    if close is not None:
        close()


class Call:
    def __init__(self, host: "Hosted", cid: int, what: str):
        self.host, self.cid, self.what = host, cid, what

    def done(self) -> bool:
        return self.cid in self.host._results or self.host._poll(self.cid, 0.0)

    def result(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.host._poll(self.cid, min(0.5, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.host.name}: no answer to {self.what} within {timeout:.0f} s")
        status, value = self.host._results.pop(self.cid)
        if status == "died":
            raise HostedDied(f"{self.host.name} died before answering {self.what}")
        if status == "error":
            raise HostedError(value)
        return value


class Hosted:
    def __init__(self, name: str, cls_path: str, kwargs: dict[str, Any]):
        self.name, self.cls_path = name, cls_path
        self.cmd = _CTX.Queue()
        self.rx, w = _CTX.Pipe(duplex=False)
        self.proc = _CTX.Process(target=_main, args=(name, cls_path, kwargs, self.cmd, w), daemon=False)
        self.proc.start()
        w.close()
        self._ids = itertools.count(1)
        self._results: dict[int, tuple[str, Any]] = {}
        self._lock = threading.Lock()
        self._started = Call(self, 0, f"the constructor of {cls_path}")
        self._up = False

    def ready(self, timeout: float) -> None:
        if not self._up:
            self._started.result(timeout)
            self._up = True

    def started(self) -> bool:
        """True once the constructor has returned or failed (``ready`` then says which) or the child died."""
        return self._up or self._started.done()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def call(self, method: str, *args: Any, **kw: Any) -> Call:
        cid = next(self._ids)
        self.cmd.put((cid, method, args, kw))
        return Call(self, cid, f"{method}()")

    def _poll(self, cid: int, wait_s: float) -> bool:
        """True once call ``cid`` has an outcome (an answer, or the child's death)."""
        with self._lock:
            if cid in self._results:
                return True
            try:
                if self.rx.poll(wait_s):
                    got, status, value = self.rx.recv()
                    self._results[got] = (status, value)
                    return got == cid
            except (EOFError, OSError):  # every answer the child sent has been read: it is gone
                self._results[cid] = ("died", None)
                return True
            if not self.proc.is_alive():
                try:
                    if self.rx.poll(0):
                        return False  # answers still in the pipe: read them first
                except (EOFError, OSError):
                    pass
                self._results[cid] = ("died", None)
                return True
            return False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.join(10)

    def close(self, timeout: float = 60.0) -> None:
        """Ask the object to close (its ``close()``), wait up to ``timeout``, then kill what is left."""
        if self.proc.is_alive():
            self.cmd.put(None)
            self.proc.join(timeout)
        self.kill()
