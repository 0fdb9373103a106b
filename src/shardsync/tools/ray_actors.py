"""Ray actors for tests and demos, syncing through ``integrations/ray``: trainer ranks (a PP share each, or
everything when data-parallel; the weights of version v are the spec's, as in ``cluster_procs``), zoo engines
(vLLM loader semantics) and real vLLM engines (an ``LLM`` inside the actor, pull mode); engines check themselves
byte for byte (a vLLM engine against a FRESH engine started on the same weights)."""

from __future__ import annotations

from typing import Any

import ray
import torch

from ..errors import TransportError
from ..integrations.ray import start_consumer, start_producer
from ..transport import make_transport
from ..transport.rdt import RdtServing
from ..zoo import ZooConfig, hf_state_dict
from .cluster_procs import VersionedSource
from .harness import vllm_engine as harness_vllm
from .harness.consumers import ZooConsumer


@ray.remote(num_cpus=0, enable_tensor_transport=True, max_concurrency=4)  # rdt reads run while sync() does
class TrainerRank(RdtServing):
    def __init__(self, spec: dict, rank: int, n: int, *, group: str, n_consumers: int, replicated: bool = False,
                 **pcfg: Any):
        torch.set_num_threads(1)
        self.source = VersionedSource.make(spec, rank, n, replicated=replicated)
        self.producer = start_producer(self.source, group=group, rank=rank, n_producers=n, n_consumers=n_consumers,
                                       **pcfg)

    def init(self) -> bool:
        self.producer.init()
        return True

    def sync(self, version: int) -> dict[str, Any]:
        self.source.set_version(version)
        r = self.producer.sync(version)
        return {k: r[k] for k in ("bytes_sent", "completed", "dropped", "seconds")}

    def close(self) -> None:
        self.producer.close()


@ray.remote(num_cpus=0)
class ZooEngine:
    def __init__(self, consumer_id: str, cfg: dict, tp: int, tp_rank: int, *, group: str, **ckw: Any):
        torch.set_num_threads(1)
        self.zc = ZooConfig(**cfg)
        self.zoo = ZooConsumer(self.zc, consumer_id, tp=tp, tp_rank=tp_rank)
        self.consumer = start_consumer(consumer_id, group=group, record=self.zoo.record, apply=self.zoo.apply, **ckw)

    def init(self) -> bool:
        self.consumer.init()
        return True

    def sync(self, version: int) -> dict[str, Any]:
        try:
            r = self.consumer.sync(version)
            return {"ok": True, "version": version, "bytes_received": r["bytes_received"],
                    "pulled_from": r["pulled_from"]}
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "torn": self.consumer.torn}

    def check(self) -> dict[str, Any]:
        """The weights this engine holds vs a fresh load of the version it reports."""
        v = self.consumer.version
        if v == 0 or self.consumer.torn:
            return {"version": v, "torn": self.consumer.torn, "mismatched": None}
        return {"version": v, "torn": False, "mismatched": self.zoo.mismatched(hf_state_dict(self.zc, seed=v))}

    def close(self) -> None:
        self.consumer.close()


@ray.remote(num_cpus=0)
class VllmEngine(harness_vllm.VllmEngine):
    """One real vLLM engine (TP ``tp``, its own executor inside this actor: vLLM's Ray executor does not run on CPU)
    whose workers pull from the group's producers."""

    def __init__(self, model_dir: str, replica: str, *, group: str, tp: int = 1, timeout_s: float = 300.0):
        super().__init__(model_dir, name=replica, tp=tp, group=group, timeout_s=timeout_s, connect=False)

    def init(self) -> bool:
        super().init()
        return True

    def check(self, version: int) -> dict[str, Any]:
        """Equal to a FRESH engine started on the trainer's weights of ``version``?"""
        from ..integrations.vllm.checkpoints import load_checkpoint, perturb

        exact, bad, n = self.check_against_fresh(perturb(load_checkpoint(self.model_dir), version))
        return {"exact": exact, "mismatched": bad[:5], "compared": n}


def close_actors(actors: list, group: str, *, timeout_s: float = 10.0, kill: bool = False) -> None:
    """Close each actor's producer or consumer (bounded: a dead actor is skipped), optionally kill it, and forget
    the group's registry entry."""
    from ..integrations.ray import forget

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
