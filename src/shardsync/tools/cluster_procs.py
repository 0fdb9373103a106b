"""The child processes of :mod:`localcluster`: one trainer rank (producer) or one zoo consumer each.

Each reads commands from its queue and answers on its own pipe. A failed sync is an answer, not the
end of the process (``{"error": ...}``): the run goes on, as a real one would. Fault injection is real:
``("sync", v, {"die_at_chunk": k})`` makes the process SIGKILL itself right after its k-th chunk read,
``{"die_at_apply": k}`` in the middle of applying its k-th group, ``{"die_after_groups": k}`` (producer)
after gathering its k-th group.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any

import torch

from ..plan.groups import weight_group
from ..zoo import ZooConfig
from .trainer_ranks import FSDPRank, MegatronRank


def pp_share(names: list[str], rank: int, n: int) -> list[str]:
    """Names pipeline stage ``rank`` of ``n`` holds: a contiguous block of layers (+pre on 0, +post on last)."""
    layers = sorted({int(weight_group(x).rsplit(".", 1)[1]) for x in names if weight_group(x) not in ("pre", "post")})
    per = -(-len(layers) // n)
    mine = set(layers[rank * per:(rank + 1) * per])
    out = []
    for x in names:
        g = weight_group(x)
        if (g == "pre" and rank == 0) or (g == "post" and rank == n - 1) or \
                (g not in ("pre", "post") and int(g.rsplit(".", 1)[1]) in mine):
            out.append(x)
    return out


def weights_at(spec: dict):
    """``version -> full HF state dict`` of the trainer (seed = version), the same in every process."""
    if spec["kind"] == "fsdp":  # a real trainer: rank 0 writes what it holds after each step
        from safetensors.torch import load_file

        return lambda v: load_file(os.path.join(spec["dir"], f"v{v}.safetensors"))
    if spec["kind"] in ("zoo", "megatron"):
        from ..zoo import hf_state_dict

        zc = ZooConfig(**spec["cfg"])
        return lambda v: hf_state_dict(zc, seed=v)
    from ..integrations.vllm.checkpoints import load_checkpoint, perturb

    base = load_checkpoint(spec["path"])
    return lambda v: perturb(base, v)


class VersionedSource:
    """Factory for a trainer rank's source whose weights change every step (seed = version)."""

    @staticmethod
    def make(spec: dict, rank: int, n: int, *, replicated: bool = False):
        """Rank ``rank`` of ``n``: a PP share of the layers, or (``replicated``, data-parallel ranks) everything."""
        if spec["kind"] == "megatron":
            return MegatronRank(spec, rank, n)
        if spec["kind"] == "fsdp":
            return FSDPRank(spec, rank, n)
        from ..source import ModuleSource

        at = weights_at(spec)
        first = at(0)
        names = list(first)

        class Source(ModuleSource):
            def set_version(self, v: int) -> None:
                sd = at(v)
                self._state = {k: sd[k] for k in names}

        return Source(first, held=None if replicated else pp_share(names, rank, n))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _failure(e: BaseException) -> dict[str, Any]:
    return {"error": f"{type(e).__name__}: {e}", "kind": type(e).__name__, "t": time.time()}


def producer_main(rank: int, n: int, spec: dict, pcfg: dict, cmd: Any, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        from ..engine.producer import Producer, ProducerConfig

        src = VersionedSource.make(spec, rank, n)
        bl = pcfg.pop("baseline", None)
        prod = Producer(src, ProducerConfig(**pcfg))
        out.send(("address", rank, prod.address))
        prod.init()
        if bl:
            from . import baseline

            groups = baseline.init_baseline(rank, bl["world"], bl["port"], n)
            held = [pp_share([m.name for m in src.metadata()], p, n) for p in range(n)]
            owner = baseline.owners(held, src.metadata())
        out.send(("ready", rank, dict(prod.stats, pid=os.getpid())))
        batches = src.iter_groups
        while (msg := cmd.get()) is not None:
            kind, v, fault = msg if len(msg) == 3 else (*msg, None)
            if kind == "prepare":  # the training step: new weights (not part of the timed sync)
                src.set_version(v)
                out.send(("prepared", rank, None))
            elif kind == "baseline":
                out.send(("synced", rank, {"seconds": baseline.broadcast_send(src, src.metadata(), owner, rank, groups),
                                          "bytes_sent": 0, "max_resident": 0, "lookahead": 0}))
            else:
                if fault and "die_after_groups" in fault:
                    left = [fault["die_after_groups"]]

                    def dying_batches(_g=batches, _left=left):
                        for batch in _g():
                            yield batch
                            _left[0] -= 1
                            if _left[0] <= 0:
                                _die()

                    src.iter_groups = dying_batches
                try:
                    if fault and fault.get("nonblocking"):  # asynchronous RL: training goes on while it serves
                        pending = prod.sync(v, block=False)
                        src.set_version(v + 1000)  # the next optimizer step changes the weights under the sync
                        r = dict(pending.result(), returned_before_served=not pending.done() or None)
                    else:
                        r = prod.sync(v)
                    out.send(("synced", rank, dict(r, held_bytes=prod.held_bytes())))
                except Exception as e:
                    out.send(("synced", rank, dict(_failure(e), held_bytes=prod.held_bytes())))
        prod.close()
    except BaseException as e:  # report, never hang the parent
        out.send(("error", rank, f"producer {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def consumer_main(cid: str, tp: int, tp_rank: int, cfg: dict, coord: list, token: str, ccfg: dict,
                  cmd: Any, bl: dict | None, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        from ..engine.consumer import Consumer
        from ..zoo import hf_state_dict
        from .harness.consumers import ZooConsumer

        zc = ZooConfig(**cfg)
        ccfg = dict(ccfg)
        spec = ccfg.pop("check_spec", None)  # what the trainer holds at each version (default: the zoo weights)
        faults: dict[str, int] = {}

        def after_apply(group: str) -> None:
            if "die_at_apply" in faults:
                faults["die_at_apply"] -= 1
                if faults["die_at_apply"] <= 0:
                    _die()  # after the group's bytes were written: mid-apply of the version

        zoo = ZooConsumer(zc, cid, tp=tp, tp_rank=tp_rank, on_apply=after_apply)
        cons = Consumer(cid, coord, token=token, record=zoo.record, apply=zoo.apply, **ccfg)
        read = cons.transport.read

        def counting_read(*a, **k):
            read(*a, **k)
            if "die_at_chunk" in faults:
                faults["die_at_chunk"] -= 1
                if faults["die_at_chunk"] <= 0:
                    _die()

        cons.transport.read = counting_read  # type: ignore[method-assign]
        cons.init()
        if bl:
            from . import baseline

            groups = baseline.init_baseline(bl["rank"], bl["world"], bl["port"], bl["producers"])
            metas = list(cons.metas)
            names = [m.name for m in metas]
            owner = baseline.owners([pp_share(names, p, bl["producers"]) for p in range(bl["producers"])], metas)
        out.send(("ready", cid, dict(cons.stats, pid=os.getpid())))
        holds = {"version": 0, "torn": False}  # what `live` holds: the last sync that wrote it, by either path
        while (msg := cmd.get()) is not None:
            kind, v, fault = msg if len(msg) == 3 else (*msg, None)
            if kind == "check":  # fail closed: a torn consumer serves nothing; else it must hold its version exactly
                state = {**holds, "rejoins": cons.rejoins}
                if not holds["torn"]:  # version 0: never synced, its initial weights are no trainer version
                    held = holds["version"]
                    state["mismatched"] = zoo.mismatched(weights_at(spec)(held) if spec else
                                                         hf_state_dict(zc, seed=held)) if held else []
                out.send(("checked", cid, state))
                continue
            if kind == "baseline":  # full tensors broadcast, loaded by the model's own loaders
                secs, got = baseline.broadcast_receive(metas, owner, groups, zoo.live.load_weights)
                holds.update(version=v, torn=False)
                out.send(("synced", cid, {"seconds": secs, "bytes_received": got}))
                continue
            faults.clear()
            faults.update(fault or {})
            before = (cons.version, cons.torn)
            try:
                out.send(("synced", cid, cons.sync(v)))
            except Exception as e:
                out.send(("synced", cid, dict(_failure(e), torn=cons.torn, version=cons.version)))
            if (cons.version, cons.torn) != before:  # a failed sync that wrote nothing leaves `live` as it was
                holds.update(version=cons.version, torn=cons.torn)
        cons.close()
    except BaseException as e:
        out.send(("error", cid, f"consumer {cid}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
