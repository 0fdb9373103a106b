"""Ray actors for tests and benchmarks, syncing through ``integrations/ray``: the local cluster's children
(``cluster_procs``) as actors that find their group by name — trainer ranks (a PP share each, or everything when
data-parallel) and zoo engines (vLLM loader semantics) — and the harness's real vLLM engine (an ``LLM`` inside the
actor, pull mode); engines check themselves byte for byte (a vLLM engine against a FRESH engine started on the
same weights). Also the rdt transport's contract pair (``RdtBuffer``, ``RdtReader``)."""

from __future__ import annotations

from typing import Any

import ray
import torch

from ...errors import TransportError
from ...transport import make_transport
from ...transport.rdt import RdtServing
from . import vllm_replica as vllm_engine
from .cluster_procs import ConsumerProc, TrainerProc

__all__ = ["TrainerRank", "ZooEngine", "VllmEngine", "RdtBuffer", "RdtReader", "close_actors"]


@ray.remote(num_cpus=0, enable_tensor_transport=True, max_concurrency=4)  # rdt reads run while sync() does
class TrainerRank(RdtServing, TrainerProc):
    def __init__(self, spec: dict, rank: int, n: int, *, group: str, n_consumers: int, replicated: bool = False,
                 **pcfg: Any):
        super().__init__(spec, rank, n, dict(pcfg, n_consumers=n_consumers), replicated=replicated, group=group)

    def init(self) -> bool:
        super().init()
        return True

    def sync(self, version: int, fault: dict | None = None) -> dict[str, Any]:
        """The training step (new weights), then this rank serves ``version``."""
        self.prepare(version)
        return super().sync(version, fault)


@ray.remote(num_cpus=0)
class ZooEngine(ConsumerProc):
    def __init__(self, consumer_id: str, cfg: dict, tp: int, tp_rank: int, *, group: str, **ckw: Any):
        super().__init__(consumer_id, cfg, tp, tp_rank, group=group, ccfg=ckw)

    def init(self) -> bool:
        super().init()
        return True


@ray.remote(num_cpus=0)
class VllmEngine(vllm_engine.VllmEngine):
    """One real vLLM engine (TP ``tp``, its own executor inside this actor: vLLM's Ray executor does not run on CPU)
    whose workers pull from the group's producers."""

    def __init__(self, model_dir: str, replica: str, *, group: str, tp: int = 1, timeout_s: float = 300.0):
        super().__init__(model_dir, name=replica, tp=tp, group=group, timeout_s=timeout_s, connect=False)

    def init(self) -> bool:
        super().init()
        return True

    def check(self, version: int) -> dict[str, Any]:
        """Equal to a FRESH engine started on the trainer's weights of ``version``?"""
        from ...verify.checkpoints import load_checkpoint, perturb

        exact, bad, n = self.check_against_fresh(perturb(load_checkpoint(self.model_dir), version))
        return {"exact": exact, "mismatched": bad[:5], "compared": n}


def close_actors(actors: list, group: str, *, timeout_s: float = 10.0, kill: bool = False) -> None:
    """Close each actor's producer or consumer (bounded: a dead actor is skipped), optionally kill it, and forget
    the group's registry entry."""
    from ...integrations.ray import forget

    for a in actors:
        try:
            ray.get(a.close.remote(), timeout=timeout_s)
        except Exception:
            pass
        if kill:
            ray.kill(a)
    forget(group)


def pattern(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) * 7 % 251).to(torch.uint8)


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class RdtBuffer(RdtServing):
    """A producer actor serving a byte pattern through the rdt transport (its contract test)."""

    def __init__(self, n: int):
        self.t, self.buf = make_transport("rdt"), pattern(n)

    def register(self) -> dict[str, Any]:
        return self.t.register(self.buf)


@ray.remote(num_cpus=0)
class RdtReader:
    """A consumer actor reading ranges through the rdt transport: ("ok", exact?) or ("error", "Type: message")."""

    def __init__(self, desc: dict[str, Any]):
        self.t = make_transport("rdt")
        self.t.connect(0, desc)
        self.n = int(desc["nbytes"])

    def read(self, off: int, n: int, timeout_s: float = 30.0) -> tuple[str, Any]:
        into = torch.zeros(n + 3, dtype=torch.uint8)
        try:
            self.t.read(0, off, n, into, timeout_s=timeout_s)
        except TransportError as e:
            return "error", f"TransportError: {e}"
        except Exception as e:
            return "error", f"{type(e).__name__}: {e}"
        return "ok", bool(torch.equal(into[:n], pattern(self.n)[off: off + n]) and not into[n:].any())
