"""``hosted.Hosted``'s interface over a Ray actor: the demo runs the same worker classes as actors with ``--ray``.

    h = RayHosted("r0", "shardsync.tools.harness.vllm_engine:VllmEngine", kwargs)   # a named actor (namespace shardsync)
    h.ready(600); h.call("generate", prompts).result(60); h.kill()             # ray.kill: the actor process dies

Errors map as in ``hosted``: the actor's exception -> :class:`HostedError`, a dead actor -> :class:`HostedDied`.
"""

from __future__ import annotations

from typing import Any

import ray

from .hosted import HostedDied, HostedError, _load

__all__ = ["RayHosted"]


class _RayCall:
    def __init__(self, host: "RayHosted", ref: Any, what: str):
        self.host, self.ref, self.what = host, ref, what

    def done(self) -> bool:
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def result(self, timeout: float) -> Any:
        try:
            return ray.get(self.ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{self.host.name}: no answer to {self.what} within {timeout:.0f} s") from None
        except ray.exceptions.ActorDiedError as e:
            raise HostedDied(f"{self.host.name} died before answering {self.what}: {str(e)[-1500:]}") from None
        except ray.exceptions.RayTaskError as e:
            raise HostedError(f"{self.host.name}.{self.what}: {str(e)[-2000:]}") from None


class RayHosted:
    def __init__(self, name: str, cls_path: str, kwargs: dict[str, Any]):
        self.name, self.cls_path = name, cls_path
        cls = ray.remote(_load(cls_path))
        self.actor = cls.options(name=f"demo-{name}", namespace="shardsync", num_cpus=0,
                                 max_restarts=0).remote(**kwargs)
        self._started = _RayCall(self, self.actor.__ray_ready__.remote(), f"the constructor of {cls_path}")
        self._alive = True

    def ready(self, timeout: float) -> None:
        self._started.result(timeout)

    def started(self) -> bool:
        return self._started.done()

    def alive(self) -> bool:
        return self._alive

    def call(self, method: str, *args: Any, **kw: Any) -> _RayCall:
        return _RayCall(self, getattr(self.actor, method).remote(*args, **kw), f"{method}()")

    def kill(self) -> None:
        self._alive = False
        ray.kill(self.actor, no_restart=True)

    def close(self, timeout: float = 60.0) -> None:
        if self._alive:
            try:
                self.call("close").result(timeout)
            except Exception:
                pass
        self.kill()
