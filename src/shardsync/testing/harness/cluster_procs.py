"""The local cluster's children, each hosted in a process of its own (``hosts.Hosted``): one trainer rank with its
producer (:class:`TrainerProc`) or one zoo consumer (:class:`ConsumerProc`). The Ray trainer and zoo engine actors
(``ray_actors``) are the same classes, found through the group's registry (``group=``).

A failed sync is an answer, not the end of the process (``{"error": ...}``): the run goes on, as a real one
would. Fault injection is real: ``sync(v, {"die_at_chunk": k})`` makes the process SIGKILL itself right after
its k-th chunk read, ``{"die_at_apply": k}`` in the middle of applying its k-th group, ``{"die_after_groups": k}``
(producer) after gathering its k-th group, ``{"flip_at_chunk": k}`` flips a bit of the k-th chunk as it lands,
``{"stall_at_chunk": k, "stall_s": t}`` stops for ``t`` seconds after its k-th chunk read while its heartbeat keeps
the lease (a straggler),
``{"replay": "record"}`` starts keeping every chunk that passes its check and ``{"replay": "version"}`` (``"group"``,
``"producer"``) then has one chunk arrive as a kept one from an earlier version (another group, another producer),
with its tag (``tamper.ChunkReplay``; ``replayed`` in the answer), ``{"fail_at_begin": True}`` (producer) fails this
rank's start of the version (it stays alive). ``baseline(v)`` is the same version through the broadcast baseline
(``programs/baseline.py``); ``check()`` compares what a consumer holds with its own loaders on the trainer's weights.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from ...errors import SyncError
from ..zoo import ZooConfig, hf_state_dict
from .consumers import ZooConsumer
from .trainers import VersionedSource, pp_share, serve, weights_at

__all__ = ["TrainerProc", "ConsumerProc"]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _failure(e: BaseException) -> dict[str, Any]:
    return {"error": f"{type(e).__name__}: {e}", "kind": type(e).__name__, "t": time.time()}


def _countdown(faults: dict[str, int], key: str) -> None:
    if key in faults:
        faults[key] -= 1
        if faults[key] <= 0:
            _die()


class TrainerProc:
    """Trainer rank ``rank`` of ``n`` (``VersionedSource.make(spec, ...)``) and its producer (``pcfg``: the
    :class:`ProducerConfig` fields, or with ``group`` those of ``integrations.ray.start_producer``)."""

    def __init__(self, spec: dict, rank: int, n: int, pcfg: dict[str, Any], *, baseline: dict | None = None,
                 replicated: bool = False, group: str | None = None):
        torch.set_num_threads(1)
        self.rank, self.n, self.bl = rank, n, baseline
        self.source = VersionedSource.make(spec, rank, n, replicated=replicated)
        self.producer = serve(self.source, group=group, **dict(pcfg, rank=rank, n_producers=n))
        self._batches = self.source.iter_groups

    def address(self) -> Any:
        return self.producer.address

    def refused(self) -> dict[str, int]:
        """What this rank's control server refused, by reason (``token``, ``frame``, ``decode``, ``mac``)."""
        return dict(self.producer.server.refused)

    def init(self) -> dict[str, Any]:
        """Waits until every consumer has registered (and joins the baseline's world, if any)."""
        self.producer.init()
        if self.bl:
            from ...programs import baseline

            self.groups = baseline.init_baseline(self.rank, self.bl["world"], self.bl["port"], self.n)
            metas = self.source.metadata()
            self.owner = baseline.owners([pp_share([m.name for m in metas], p, self.n) for p in range(self.n)], metas)
        return dict(self.producer.stats, pid=os.getpid())

    def prepare(self, version: int) -> None:
        """The training step: new weights (not part of the timed sync)."""
        self.source.set_version(version)

    def sync(self, version: int, fault: dict | None = None) -> dict[str, Any]:
        if fault and fault.get("fail_at_begin"):  # this rank cannot start the version (its engines are gone)
            begin = self.producer._begin

            def failing(v: int):
                self.producer._begin = begin
                raise SyncError(f"injected: producer {self.rank} cannot start version {v}")

            self.producer._begin = failing
        if fault and "die_after_groups" in fault:
            left = {"groups": fault["die_after_groups"]}

            def dying_batches(_g=self._batches):
                for batch in _g():
                    yield batch
                    _countdown(left, "groups")

            self.source.iter_groups = dying_batches
        try:
            if fault and fault.get("nonblocking"):  # asynchronous RL: training goes on while it serves
                pending = self.producer.sync(version, block=False)
                self.source.set_version(version + 1000)  # the next optimizer step changes the weights under the sync
                r = dict(pending.result(), returned_before_served=not pending.done() or None)
            else:
                r = self.producer.sync(version)
            return dict(r, held_bytes=self.producer.held_bytes())
        except Exception as e:
            return dict(_failure(e), held_bytes=self.producer.held_bytes())

    def baseline(self, version: int) -> dict[str, Any]:
        from ...programs import baseline

        secs = baseline.broadcast_send(self.source, self.source.metadata(), self.owner, self.rank, self.groups)
        return {"seconds": secs, "bytes_sent": 0, "max_resident": 0, "lookahead": 0}

    def close(self) -> None:
        self.producer.close()


class ConsumerProc:
    """Zoo consumer ``cid`` (TP rank ``tp_rank`` of ``tp``): a :class:`ZooConsumer` and the engine's ``Consumer``
    writing into it (``ccfg``: its options; ``check_spec``: what the trainer holds at each version, default the
    zoo weights of ``cfg``), pulling from ``coordinator`` — or, with ``group``, from the Ray group of that name."""

    def __init__(self, cid: str, cfg: dict, tp: int, tp_rank: int, *, coordinator: list | None = None,
                 token: str = "", group: str | None = None, ccfg: dict | None = None, baseline: dict | None = None):
        from ...engine.consumer.consumer import Consumer

        torch.set_num_threads(1)
        self.zc = ZooConfig(**cfg)
        ccfg = dict(ccfg or {})
        self.spec = ccfg.pop("check_spec", None)
        self.bl = baseline
        self.faults: dict[str, int] = {}
        self.zoo = ZooConsumer(self.zc, cid, tp=tp, tp_rank=tp_rank,  # dies after a group's bytes: mid-apply
                               on_apply=lambda _g: _countdown(self.faults, "die_at_apply"))
        if group is not None:
            from ...integrations.ray import start_consumer

            self.consumer = start_consumer(cid, group=group, record=self.zoo.record, apply=self.zoo.apply, **ccfg)
        else:
            live = ccfg.pop("read_back", False)  # delta bases read back from the parameters: no held copy
            self.consumer = Consumer(cid, coordinator, token=token, record=self.zoo.record, apply=self.zoo.apply,
                                     read_back=self.zoo.read_back if live else None, **ccfg)
        read = self.consumer.transport.read

        def counting_read(p, off, n, into, **k):
            read(p, off, n, into, **k)
            if "flip_at_chunk" in self.faults:
                self.faults["flip_at_chunk"] -= 1
                if self.faults["flip_at_chunk"] <= 0:
                    del self.faults["flip_at_chunk"]
                    into[n // 2] ^= 1  # one bit, in transit
            _countdown(self.faults, "die_at_chunk")
            if "stall_at_chunk" in self.faults:  # a straggler: alive (its heartbeat renews the lease), not pulling
                self.faults["stall_at_chunk"] -= 1
                if self.faults["stall_at_chunk"] <= 0:
                    del self.faults["stall_at_chunk"]
                    time.sleep(self.faults.pop("stall_s", 10.0))

        self.consumer.transport.read = counting_read  # type: ignore[method-assign]
        self.holds = {"version": 0, "torn": False}  # what the live model holds: the last sync that wrote it
        self.replay: Any = None

    def init(self) -> dict[str, Any]:
        """Hello, record, register, routes (and joins the baseline's world, if any)."""
        cons = self.consumer
        cons.init()
        if self.bl:
            from ...programs import baseline

            n = self.bl["producers"]
            self.groups = baseline.init_baseline(self.bl["rank"], self.bl["world"], self.bl["port"], n)
            self.metas = list(cons.metas)
            self.owner = baseline.owners([pp_share([m.name for m in self.metas], p, n) for p in range(n)], self.metas)
        return dict(cons.stats, pid=os.getpid())

    def sync(self, version: int, fault: dict | None = None) -> dict[str, Any]:
        cons = self.consumer
        self.faults.clear()
        self.faults.update(fault or {})
        if self.replay is not None:
            self.replay.armed = ""  # a replay asked for in an earlier sync that found no chunk to replace ends
        if "replay" in self.faults:
            from .tamper import ChunkReplay

            self.replay = self.replay or ChunkReplay()
            if self.faults["replay"] != "record":
                self.replay.arm(self.faults.pop("replay"))
        if self.faults.pop("poke_params", False):  # the engine changed every weight behind the sync's back
            with torch.no_grad():
                for t in self.zoo.params.values():
                    t.view(-1)[0] += 1
        before = (cons.version, cons.torn)
        try:
            out = dict(cons.sync(version), ok=True, version=version)
        except Exception as e:
            out = dict(_failure(e), ok=False, torn=cons.torn, version=cons.version)
        if self.replay is not None:
            out["replayed"] = list(self.replay.replayed)
        if (cons.version, cons.torn) != before:  # a failed sync that wrote nothing leaves the model as it was
            self.holds.update(version=cons.version, torn=cons.torn)
        return out

    def baseline(self, version: int) -> dict[str, Any]:
        """Full tensors broadcast, loaded by the model's own loaders: it then holds ``version``."""
        from ...programs import baseline

        secs, got = baseline.broadcast_receive(self.metas, self.owner, self.groups, self.zoo.live.load_weights)
        self.holds.update(version=version, torn=False)
        return {"seconds": secs, "bytes_received": got}

    def check(self, version: int | None = None) -> dict[str, Any]:
        """Fail closed: a torn consumer serves nothing; else it must hold its version exactly (version 0: never
        synced, its initial weights are no trainer version)."""
        state = {**self.holds, "rejoins": self.consumer.rejoins}
        if not self.holds["torn"]:
            held = self.holds["version"]
            want = (weights_at(self.spec)(held) if self.spec else hf_state_dict(self.zc, seed=held)) if held else None
            state["mismatched"] = self.zoo.mismatched(want) if held else []
        return state

    def close(self) -> None:
        self.consumer.close()
