"""Run producers and consumers as real processes on this machine (tests, ``demo``, ``bench``).

Producers hold a pipeline-parallel share of a zoo model's layers (rank 0 also ``pre``, the last rank
``post``); consumers are ``replicas × tp`` loader-zoo models with vLLM loader semantics. Every sync
the trainer's weights change (seed = version); each consumer then compares its parameters, byte for
byte, with its own loaders run on the same full tensors::

    with LocalCluster(ZooConfig.qwen3_moe_tiny(), producers=2, replicas=2, tp=2, transport="tcp") as cl:
        for v in (1, 2, 3):
            report = cl.sync(v)      # {"producers": [...], "consumers": [...]} with "exact" per consumer
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
import traceback
from dataclasses import asdict
from typing import Any

import torch

from ..plan.groups import weight_group
from ..zoo import ZooConfig

_CTX = mp.get_context("spawn")


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


class VersionedSource:
    """Factory for a trainer rank's source whose weights change every step (seed = version)."""

    @staticmethod
    def make(spec: dict, rank: int, n: int):
        from ..source import ModuleSource

        if spec["kind"] == "zoo":
            from ..zoo import hf_state_dict

            zc = ZooConfig(**spec["cfg"])
            weights_at = lambda v: hf_state_dict(zc, seed=v)  # noqa: E731
        else:  # a checkpoint on disk, perturbed deterministically per version
            from ..integrations.vllm.checkpoints import load_checkpoint, perturb

            base = load_checkpoint(spec["path"])
            weights_at = lambda v: perturb(base, v)  # noqa: E731
        first = weights_at(0)
        names = list(first)

        class Source(ModuleSource):
            def set_version(self, v: int) -> None:
                sd = weights_at(v)
                self._state = {k: sd[k] for k in names}

        return Source(first, held=pp_share(names, rank, n))


def _producer_main(rank: int, n: int, spec: dict, pcfg: dict, cmd: Any, out: Any) -> None:
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
        out.send(("ready", rank, prod.stats))
        while (msg := cmd.get()) is not None:
            kind, v = msg
            if kind == "prepare":  # the training step: new weights (not part of the timed sync)
                src.set_version(v)
                out.send(("prepared", rank, None))
            elif kind == "baseline":
                out.send(("synced", rank, {"seconds": baseline.broadcast_send(src, src.metadata(), owner, rank, groups),
                                          "bytes_sent": 0, "max_resident": 0, "lookahead": 0}))
            else:
                out.send(("synced", rank, prod.sync(v)))
        prod.close()
    except BaseException as e:  # report, never hang the parent
        out.send(("error", rank, f"producer {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def _consumer_main(cid: str, tp: int, tp_rank: int, cfg: dict, coord: list, token: str, transport: str,
                   timeout_s: float, cmd: Any, bl: dict | None, out: Any) -> None:
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

        def apply(group: str, buf: torch.Tensor) -> None:
            if group not in unpackers:
                g = cons.plan.group(group)
                unpackers[group] = GroupUnpacker(g, layout_group(g))
            unpackers[group].unpack(buf, params)

        cons = Consumer(cid, coord, token=token, record=record, apply=apply, transport=transport, timeout_s=timeout_s)
        cons.init()
        if bl:
            from . import baseline

            groups = baseline.init_baseline(bl["rank"], bl["world"], bl["port"], bl["producers"])
            metas = [m for m in cons.metas]
            names = [m.name for m in metas]
            owner = baseline.owners([pp_share(names, p, bl["producers"]) for p in range(bl["producers"])], metas)
        out.send(("ready", cid, cons.stats))
        while (msg := cmd.get()) is not None:
            kind, v = msg
            if kind == "check":  # after every process finished the sync: compare with our own loaders
                ref = ZooModel(zc, tp_size=tp, tp_rank=tp_rank)
                ref.load_weights(hf_state_dict(zc, seed=v).items())
                bad = mismatched(live.state_dict(), ref.state_dict())
                out.send(("checked", cid, bad))
                continue
            if kind == "baseline":  # full tensors broadcast, loaded by the model's own loaders
                secs, got = baseline.broadcast_receive(metas, owner, groups, live.load_weights)
                stats = {"seconds": secs, "bytes_received": got}
            else:
                stats = cons.sync(v)
            out.send(("synced", cid, stats))
        cons.close()
    except BaseException as e:
        out.send(("error", cid, f"consumer {cid}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


class _Inbox:
    """Results from the children, one pipe each: a child killed mid-write (fault injection) cannot
    leave a shared lock held — with one ``multiprocessing.Queue`` for all, it could, and every other
    child's next message would block forever."""

    def __init__(self) -> None:
        self.readers: list[Any] = []

    def writer(self) -> Any:
        r, w = _CTX.Pipe(duplex=False)
        self.readers.append(r)
        return w

    def get(self, timeout: float) -> tuple[Any, Any, Any]:
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        while self.readers:
            ready = wait(self.readers, max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for r in ready:
                try:
                    return r.recv()
                except (EOFError, OSError):  # that child is gone
                    self.readers.remove(r)
        raise TimeoutError


class LocalCluster:
    """``external_consumers=N`` starts only the producers (and a coordinator expecting N consumers, e.g.
    vLLM workers started by the caller): call :meth:`wait_ready` once those have initialised."""

    def __init__(self, cfg: ZooConfig | None, *, producers: int = 2, replicas: int = 2, tp: int = 2,
                 transport: str = "tcp", lookahead: int = 1, max_chunk_bytes: int = 1 << 20, timeout_s: float = 60.0,
                 spec: dict | None = None, external_consumers: int = 0, baseline: bool = False):
        self.cfg, self.n_p, self.replicas, self.tp = cfg, producers, replicas, tp
        self.timeout_s = timeout_s
        self.inbox = _Inbox()
        self.token = secrets.token_hex(8)
        self.procs: list[Any] = []
        self.cmds: dict[Any, Any] = {}
        self.by_key: dict[Any, Any] = {}
        c = asdict(cfg) if cfg is not None else {}
        n_cons = external_consumers or replicas * tp
        base = dict(n_producers=producers, n_consumers=n_cons, token=self.token, transport=transport,
                    lookahead=lookahead, max_chunk_bytes=max_chunk_bytes, timeout_s=timeout_s)
        bl = None
        if baseline:
            import socket

            with socket.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                bl = {"port": sk.getsockname()[1], "world": producers + n_cons, "producers": producers}
            base["baseline"] = bl
        q0 = _CTX.Queue()
        spec = spec or {"kind": "zoo", "cfg": c}
        self._start(_producer_main, (0, producers, spec, dict(base, rank=0), q0), 0, q0)
        coord = self._expect("address", {0})[0]
        for r in range(1, producers):
            q = _CTX.Queue()
            self._start(_producer_main, (r, producers, spec, dict(base, rank=r, coordinator=coord), q), r, q)
        self._expect("address", set(range(1, producers)))
        self.coordinator = coord
        self.consumer_ids: list[str] = []
        if external_consumers:
            return
        self.consumer_ids = [f"r{i}/tp{t}" for i in range(replicas) for t in range(tp)]
        for cid in self.consumer_ids:
            q = _CTX.Queue()
            t = int(cid.split("tp")[1])
            cbl = None if bl is None else dict(bl, rank=producers + self.consumer_ids.index(cid))
            self._start(_consumer_main, (cid, tp, t, c, coord, self.token, transport, timeout_s, q, cbl),
                        cid, q)
        self.wait_ready()

    def wait_ready(self) -> list[Any]:
        self.init_stats = self._expect("ready", set(range(self.n_p)) | set(self.consumer_ids))
        return self.init_stats

    def _start(self, fn, args, key, q) -> None:
        """The child's result pipe is appended to ``args``."""
        w = self.inbox.writer()
        p = _CTX.Process(target=fn, args=(*args, w), daemon=True)
        p.start()
        w.close()  # the child holds the write end now
        self.procs.append(p)
        self.by_key[key] = p
        self.cmds[key] = q

    def kill(self, key: Any) -> None:
        """Fault injection: SIGKILL one producer (by rank) or consumer (by id)."""
        self.by_key[key].kill()
        self.by_key[key].join(5)
        del self.cmds[key]

    def _expect(self, kind: str, keys: set) -> list[Any]:
        got: dict[Any, Any] = {}
        wait = 600.0 if kind in ("address", "ready") else self.timeout_s * 3 + 60
        while keys - got.keys():
            try:
                k, who, payload = self.inbox.get(timeout=wait)
            except TimeoutError:
                raise TimeoutError(f"local cluster: no {kind!r} from {sorted(map(str, keys - got.keys()))}") from None
            if k == "error":
                raise RuntimeError(payload)
            if k == kind:
                got[who] = payload
        return [got[k] for k in sorted(got, key=str)]

    def sync(self, version: int, *, baseline: bool = False) -> dict[str, Any]:
        """One sync through shardsync (or, ``baseline=True``, through the broadcast baseline)."""
        producers = [k for k in self.cmds if isinstance(k, int)]
        consumers = [k for k in self.cmds if not isinstance(k, int)]
        for k in producers:
            self.cmds[k].put(("prepare", version))
        self._expect("prepared", set(producers))
        for q in self.cmds.values():
            q.put(("baseline" if baseline else "sync", version))
        res = dict(zip(sorted(self.cmds, key=str), self._expect("synced", set(self.cmds))))
        for k in consumers:
            self.cmds[k].put(("check", version))
        bad = dict(zip(sorted(consumers, key=str), self._expect("checked", set(consumers))))
        cons = [dict(res[k], consumer=k, mismatched=bad[k], exact=not bad[k]) for k in sorted(consumers, key=str)]
        return {"version": version, "producers": [res[k] for k in sorted(producers)], "consumers": cons,
                "exact": all(c["exact"] for c in cons)}

    def close(self) -> None:
        for q in self.cmds.values():
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
