"""Process hosts: an object living in a process of its own — a local child process (:class:`Hosted`) or a Ray actor
(:class:`RayHosted`), behind one interface. Call its methods, wait for several answers at once, kill it as a whole.

    h = Hosted("r0", "shardsync.testing.harness.vllm_replica:VllmEngine", kwargs)   # constructs it in a new process
    h.ready(timeout=600)                      # waits until the constructor returned (or raises its error)
    call = h.call("generate", prompts)        # sends the call; the object runs calls one at a time, in order
    tokens = call.result(timeout=60)          # its return value, or its exception as HostedError
    got = results({"a": h.call("sync", 3), "b": g.call("sync", 3)}, timeout=60)   # each value or exception
    h.kill()                                  # SIGKILL to its whole process group (a vLLM engine's core and workers)

    RayHosted("r0", cls_path, kwargs)         # the same, as a named Ray actor (namespace shardsync): ray.kill

Every wait has a deadline and names what it waited for; a child that dies makes every pending call fail with
:class:`HostedDied` at once (:func:`results` watches every child's pipe and process sentinel together, and
``died_at`` says when a death was seen). The local cluster, the demo, the chaos runs and ``gpu_sync.py`` run on it.
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Mapping, TypeVar

__all__ = ["Hosted", "RayHosted", "HostedError", "HostedDied", "Call", "results", "host_factory", "free_port"]

_CTX = mp.get_context("spawn")
K = TypeVar("K")


class HostedError(RuntimeError):
    """The hosted object raised: the child's exception type, message and traceback tail."""


class HostedDied(RuntimeError):
    """The child process (or actor) is gone (killed or crashed) before it answered."""


def load(path: str) -> Any:
    """``"package.module:Name"`` -> the object."""
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def _main(name: str, cls_path: str, kwargs: dict, cmd: Any, out: Any) -> None:
    os.setpgrp()  # one group: kill() takes whatever this process starts (vLLM's engine core, its workers)
    try:
        obj = load(cls_path)(**kwargs)
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

    def waitables(self) -> list[Any]:
        """What :func:`results` waits on: the child's answer pipe and its process sentinel."""
        return [self.host.rx, self.host.proc.sentinel]

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
    """``daemon=True``: the child dies with this process (it may not start processes of its own: vLLM needs
    ``daemon=False``)."""

    def __init__(self, name: str, cls_path: str, kwargs: dict[str, Any], *, daemon: bool = False):
        self.name, self.cls_path = name, cls_path
        self.cmd = _CTX.Queue()
        self.rx, w = _CTX.Pipe(duplex=False)
        self.proc = _CTX.Process(target=_main, args=(name, cls_path, kwargs, self.cmd, w), daemon=daemon)
        self.proc.start()
        w.close()
        self.died_at: float | None = None
        """When its death was first seen, or when :meth:`kill` was called (``time.time()``)."""
        self._ids = itertools.count(1)
        self._results: dict[int, tuple[str, Any]] = {}
        self._lock = threading.Lock()
        self.constructor = Call(self, 0, f"the constructor of {cls_path}")
        self._up = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def ready(self, timeout: float) -> None:
        if not self._up:
            self.constructor.result(timeout)
            self._up = True

    def started(self) -> bool:
        """True once the constructor has returned or failed (``ready`` then says which) or the child died."""
        return self._up or self.constructor.done()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def call(self, method: str, *args: Any, **kw: Any) -> Call:
        cid = next(self._ids)
        self.cmd.put((cid, method, args, kw))
        return Call(self, cid, f"{method}()")

    def _dead(self, cid: int) -> bool:
        self._results[cid] = ("died", None)
        if self.died_at is None:
            self.died_at = time.time()
        return True

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
                return self._dead(cid)
            if not self.proc.is_alive():
                try:
                    if self.rx.poll(0):
                        return False  # answers still in the pipe: read them first
                except (EOFError, OSError):
                    pass
                return self._dead(cid)
            return False

    def pause(self) -> float:
        """SIGSTOP (it keeps its state and sockets but answers nothing); returns when (``time.time()``)."""
        t = time.time()
        os.kill(self.proc.pid, signal.SIGSTOP)
        return t

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> float:
        """SIGKILL to its process group; returns when (``time.time()``)."""
        t = time.time()
        self.died_at = self.died_at or t
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.join(10)
        return t

    def close(self, timeout: float = 60.0) -> None:
        """Ask the object to close (its ``close()``), wait up to ``timeout``, then kill what is left."""
        if self.proc.is_alive():
            try:
                self.resume()  # a paused child cannot exit
            except (OSError, TypeError):
                pass
            self.cmd.put(None)
            self.proc.join(timeout)
        self.kill()


def results(calls: Mapping[K, Any], timeout: float) -> dict[K, Any]:
    """Every call's result, or its exception (:class:`HostedDied`, :class:`HostedError`, ``TimeoutError`` past the
    shared deadline). Local calls are waited on together: a death is seen the moment it happens."""
    deadline = time.monotonic() + timeout
    out: dict[K, Any] = {}
    pending = dict(calls)
    while pending:
        for k, c in list(pending.items()):
            if c.done():
                try:
                    out[k] = c.result(0)
                except (HostedDied, HostedError, TimeoutError) as e:
                    out[k] = e
                del pending[k]
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            break
        if all(c.waitables() for c in pending.values()):
            wait(list({id(w): w for c in pending.values() for w in c.waitables()}.values()), min(left, 5.0))
        else:  # a Ray call among them: poll
            time.sleep(min(left, 0.05))
    for k, c in pending.items():
        out[k] = TimeoutError(f"{c.host.name}: no answer to {c.what} within {timeout:.0f} s")
    return {k: out[k] for k in calls}


class _RayCall:
    def __init__(self, host: "RayHosted", ref: Any, what: str):
        self.host, self.ref, self.what = host, ref, what

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def waitables(self) -> list[Any]:
        return []

    def result(self, timeout: float) -> Any:
        import ray

        try:
            return ray.get(self.ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{self.host.name}: no answer to {self.what} within {timeout:.0f} s") from None
        except ray.exceptions.ActorDiedError as e:
            raise HostedDied(f"{self.host.name} died before answering {self.what}: {str(e)[-1500:]}") from None
        except ray.exceptions.RayTaskError as e:
            raise HostedError(f"{self.host.name}.{self.what}: {str(e)[-2000:]}") from None


class RayHosted:
    """:class:`Hosted`'s interface over a named Ray actor (namespace ``shardsync``): the actor's exception ->
    :class:`HostedError`, a dead actor -> :class:`HostedDied`; :meth:`kill` is ``ray.kill``."""

    def __init__(self, name: str, cls_path: str, kwargs: dict[str, Any]):
        import ray

        self.name, self.cls_path = name, cls_path
        cls = ray.remote(load(cls_path))
        self.actor = cls.options(name=f"demo-{name}", namespace="shardsync", num_cpus=0,
                                 max_restarts=0).remote(**kwargs)
        self.constructor = _RayCall(self, self.actor.__ray_ready__.remote(), f"the constructor of {cls_path}")
        self._alive = True

    def ready(self, timeout: float) -> None:
        self.constructor.result(timeout)

    def started(self) -> bool:
        return self.constructor.done()

    def alive(self) -> bool:
        return self._alive

    def call(self, method: str, *args: Any, **kw: Any) -> _RayCall:
        return _RayCall(self, getattr(self.actor, method).remote(*args, **kw), f"{method}()")

    def kill(self) -> None:
        import ray

        self._alive = False
        ray.kill(self.actor, no_restart=True)

    def close(self, timeout: float = 60.0) -> None:
        if self._alive:
            try:
                self.call("close").result(timeout)
            except Exception:
                pass
        self.kill()


def free_port() -> int:
    """A free TCP port on this host (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_factory(use_ray: bool) -> type:
    """:class:`Hosted`, or :class:`RayHosted` on a Ray instance (the embedded default unless one is connected:
    ``ray.init(address=...)`` first for an existing cluster)."""
    if not use_ray:
        return Hosted
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    return RayHosted
