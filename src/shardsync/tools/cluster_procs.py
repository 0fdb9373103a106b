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
    def make(spec: dict, rank: int, n: int):
        if spec["kind"] == "megatron":
            return MegatronRank(spec, rank, n)
        from ..source import ModuleSource

        at = weights_at(spec)
        first = at(0)
        names = list(first)

        class Source(ModuleSource):
            def set_version(self, v: int) -> None:
                sd = at(v)
                self._state = {k: sd[k] for k in names}

        return Source(first, held=pp_share(names, rank, n))


def megatron_coords(par: dict, rank: int) -> dict[str, int]:
    """Megatron's rank order for TP x EP x PP (no DP beyond EP): tp fastest, then ep, then pp."""
    tp, ep = par.get("tp", 1), par.get("ep", 1)
    return {"tp_rank": rank % tp, "ep_rank": (rank // tp) % ep, "pp_rank": rank // (tp * ep)}


class MegatronRank:
    """One rank of a Megatron-style TP x EP x PP trainer (gloo among the producer processes): its local shards
    in Megatron layouts, offered through ``MegatronSource``; ``set_version`` is the training step.
    ``spec["gather"] = "everywhere"``: through :class:`GatherEverywhere` instead (``shardsync bench --mode v1``)."""

    def __init__(self, spec: dict, rank: int, n: int):
        from ..sources.megatron import MegatronConfig, MegatronParallel
        from ..sources.megatron_layout import hf_shapes
        from ..types import ParamMeta

        par = spec["par"]
        tp, ep, pp = par.get("tp", 1), par.get("ep", 1), par.get("pp", 1)
        if tp * ep * pp != n:
            raise ValueError(f"{n} producers cannot hold TP{tp} x EP{ep} x PP{pp}")
        self.spec, self.rank, self.n, self.inner, self.version = spec, rank, n, None, 0
        me = megatron_coords(par, rank)
        self.zc = ZooConfig(**spec["cfg"])
        self.mcfg = MegatronConfig.like(self.zc, dtype=self.zc.ckpt_dtype)
        moe_tp = tp > 1 and self.zc.experts
        self.par = MegatronParallel(tp=tp, pp=pp, ep=ep, etp=tp if moe_tp else 1,
                                    etp_rank=me["tp_rank"] if moe_tp else 0, **me)
        self.metas = [ParamMeta(name=k, dtype=self.mcfg.dtype, shape=s) for k, s in hf_shapes(self.mcfg).items()]

    def _source(self):
        """Joins the trainer's process group on first use (after every rank's producer is listening)."""
        if self.inner is None:
            from datetime import timedelta

            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.spec['dist_port']}", rank=self.rank,
                                    world_size=self.n, timeout=timedelta(seconds=120))
            tp = self.par.tp
            groups = {tuple(range(s, s + tp)): dist.new_group(list(range(s, s + tp)))  # same order on every rank
                      for s in range(0, self.n, tp)}
            self.tp_group = next(g for rs, g in groups.items() if self.rank in rs)
            self.set_version(self.version)
        return self.inner

    def set_version(self, v: int) -> None:
        from ..sources.megatron import MegatronSource, hf_to_megatron_shards
        from ..zoo import hf_state_dict

        self.version = v
        if not hasattr(self, "tp_group"):
            self._source()
            return
        local = hf_to_megatron_shards(hf_state_dict(self.zc, seed=v), self.mcfg, self.par)
        if getattr(self, "local", None) is not None:  # an optimizer step: the rank's tensors change IN PLACE
            for k, t in local.items():
                self.local[k].copy_(t)
            return
        self.local = local
        if self.spec.get("gather") == "everywhere":  # bench v1: every tensor on every rank
            self.inner = GatherEverywhere(local, self.mcfg, self.par, self.rank, self.n, self.spec["par"])
            return
        self.inner = MegatronSource(local, self.mcfg, self.par, tp_group=self.tp_group,
                                    etp_group=self.tp_group if self.par.etp > 1 else None)

    def metadata(self):
        return self.metas

    def held_names(self):
        return self._source().held_names()

    def groups(self):
        return self._source().groups()

    def iter_groups(self):
        return self._source().iter_groups()


class GatherEverywhere:
    """The naive trainer-side export (``bench --mode v1``): EVERY rank materialises EVERY tensor of the model,
    tensor by tensor, with one all-gather over the whole trainer world per Megatron tensor (the ranks holding
    its TP/ETP shards put them in, every other rank zeros of the same shape). ``held_names()`` is None: every
    rank holds everything, so routing may pick any rank; the world iterates every group in lockstep."""

    def __init__(self, local: dict, mcfg: Any, par: Any, rank: int, n: int, sizes: dict):
        from ..source import gather_groups
        from ..sources.megatron_layout import hf_shapes, items, local_shapes
        from ..types import ParamMeta, dtype_of

        self.local, self.mcfg, self.rank, self.n, self.dtype = local, mcfg, rank, n, dtype_of(mcfg.dtype)
        self.metas = [ParamMeta(name=k, dtype=mcfg.dtype, shape=s) for k, s in hf_shapes(mcfg).items()]
        plan: dict[tuple, tuple] = {}  # HF names -> (item, {shard index: (rank, local name)}, shard shape)
        for r in range(n):
            c = megatron_coords(sizes, r)
            pr = par.replace(**c, etp_rank=c["tp_rank"] if par.etp > 1 else 0)
            shapes = local_shapes(mcfg, pr)
            for it in items(mcfg, pr):
                split = (it.axis == "tp" and pr.tp > 1) or (it.axis == "etp" and pr.etp > 1)
                if it.export:
                    i = (pr.tp_rank if it.axis == "tp" else pr.etp_rank) if split else 0
                    plan.setdefault(it.hf, (it, {}, shapes[it.local]))[1].setdefault(i, (r, it.local))
        self._groups = gather_groups([m.name for m in self.metas])
        self._plan: dict[str, list[tuple]] = {}
        for key, (it, holders, shape) in plan.items():
            self._plan.setdefault(weight_group(key[0]), []).append((it, [holders[i] for i in sorted(holders)], shape))

    def metadata(self):
        return self.metas

    def held_names(self):
        return None

    def groups(self):
        return [list(g) for g in self._groups]

    def iter_groups(self):
        import torch.distributed as dist

        from ..sources.megatron_layout import merge

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for names in self._groups:
            out: dict[str, torch.Tensor] = {}
            for it, holders, shape in self._plan[weight_group(names[0])]:  # one world collective per tensor
                mine = next((self.local[x].contiguous() for r, x in holders if r == self.rank), None)
                mine = torch.zeros(shape, dtype=self.dtype) if mine is None else mine
                k = mine.numel()
                full = torch.empty(self.n * k, dtype=mine.dtype)
                gather(full, mine.view(-1))
                out.update(zip(it.hf, merge(it, [full[r * k:(r + 1) * k].view(shape) for r, _ in holders], self.mcfg)))
            yield list(names), [out[x] for x in names]

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
        from ..plan.pack import GroupUnpacker, layout_group
        from ..plan.record import record_plan
        from ..plan.validate import mismatched
        from ..zoo import ZooModel, hf_state_dict

        zc = ZooConfig(**cfg)
        live = ZooModel(zc, tp_size=tp, tp_rank=tp_rank)
        params = dict(live.named_parameters())

        def record(metas):
            dry = ZooModel(zc, tp_size=tp, tp_rank=tp_rank)
            return record_plan(metadata=metas, load_weights=dry.load_weights, params=dict(dry.named_parameters()),
                               consumer=cid, rank=tp_rank)

        unpackers: dict = {}
        faults: dict[str, int] = {}

        def apply(group: str, buf: torch.Tensor) -> None:
            if group not in unpackers:
                g = cons.plan.group(group)
                unpackers[group] = GroupUnpacker(g, layout_group(g))
            unpackers[group].unpack(buf, params)
            if "die_at_apply" in faults:
                faults["die_at_apply"] -= 1
                if faults["die_at_apply"] <= 0:
                    _die()  # after the group's bytes were written: mid-apply of the version

        cons = Consumer(cid, coord, token=token, record=record, apply=apply, **ccfg)
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
        while (msg := cmd.get()) is not None:
            kind, v, fault = msg if len(msg) == 3 else (*msg, None)
            if kind == "check":  # fail closed: a torn consumer serves nothing; else it must hold its version exactly
                state = {"version": cons.version, "torn": cons.torn, "rejoins": cons.rejoins}
                if not cons.torn:
                    ref = ZooModel(zc, tp_size=tp, tp_rank=tp_rank)
                    if cons.version:
                        ref.load_weights(hf_state_dict(zc, seed=cons.version).items())
                        state["mismatched"] = mismatched(live.state_dict(), ref.state_dict())
                    else:
                        state["mismatched"] = []  # never synced: holds its initial weights, not a trainer version
                out.send(("checked", cid, state))
                continue
            if kind == "baseline":  # full tensors broadcast, loaded by the model's own loaders
                secs, got = baseline.broadcast_receive(metas, owner, groups, live.load_weights)
                out.send(("synced", cid, {"seconds": secs, "bytes_received": got}))
                continue
            faults.clear()
            faults.update(fault or {})
            try:
                out.send(("synced", cid, cons.sync(v)))
            except Exception as e:
                out.send(("synced", cid, dict(_failure(e), torn=cons.torn, version=cons.version)))
        cons.close()
    except BaseException as e:
        out.send(("error", cid, f"consumer {cid}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
