"""Run producers and consumers as real processes on this machine (tests, ``demo``, ``bench``, ``chaos``).

Producers hold a pipeline-parallel share of a zoo model's layers (rank 0 also ``pre``, the last rank
``post``); consumers are ``replicas × tp`` loader-zoo models with vLLM loader semantics (the child
processes are in ``cluster_procs``). Every sync the trainer's weights change (seed = version); each
consumer then compares its parameters, byte for byte, with its own loaders run on the full tensors of
the version it says it holds — or says it is torn and serves nothing::

    with LocalCluster(ZooConfig.qwen3_moe_tiny(), producers=2, replicas=2, tp=2, transport="tcp") as cl:
        for v in (1, 2, 3):
            report = cl.sync(v)      # {"producers": [...], "consumers": [...]} with "exact" per consumer

Faults are real: :meth:`kill` (SIGKILL), :meth:`pause`/:meth:`resume` (SIGSTOP/SIGCONT),
:meth:`restart` (a new process with the same id or rank), and per-sync ``faults`` that make a child kill
itself at a given chunk, group or apply (see ``cluster_procs``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import time
from dataclasses import asdict
from typing import Any

from .cluster_procs import VersionedSource, consumer_main, pp_share, producer_main
from ..zoo import ZooConfig

__all__ = ["LocalCluster", "VersionedSource", "pp_share"]
_CTX = mp.get_context("spawn")


class _Inbox:
    """Results from the children, one pipe each: a child killed mid-write (fault injection) cannot
    leave a shared lock held — with one ``multiprocessing.Queue`` for all, it could, and every other
    child's next message would block forever. Process sentinels are watched too: a child's death is
    seen at once (``died``: key -> when)."""

    def __init__(self) -> None:
        self.readers: dict[Any, Any] = {}  # reader -> key
        self.sentinels: dict[int, Any] = {}  # sentinel -> key
        self.died: dict[Any, float] = {}

    def add(self, key: Any, reader: Any, sentinel: int) -> None:
        self.readers[reader] = key
        self.sentinels[sentinel] = key

    def forget(self, key: Any, when: float) -> None:
        """``key``'s process was killed on purpose at ``when``: its sentinel must not mark a successor dead."""
        for s, k in list(self.sentinels.items()):
            if k == key:
                del self.sentinels[s]
        self.died[key] = when

    def get(self, timeout: float) -> tuple[Any, Any, Any]:
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        while self.readers or self.sentinels:
            ready = wait([*self.readers, *self.sentinels], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            fired = None
            for r in ready:
                if r in self.sentinels:
                    fired = self.sentinels.pop(r)
                    self.died.setdefault(fired, time.time())
                    continue
                try:
                    return r.recv()
                except (EOFError, OSError):  # that child is gone
                    self.readers.pop(r, None)
            if fired is not None:
                return ("died", fired, None)
        raise TimeoutError


class LocalCluster:
    """``external_consumers=N`` starts only the producers (and a coordinator expecting N consumers, e.g.
    vLLM workers started by the caller): call :meth:`wait_ready` once those have initialised."""

    def __init__(self, cfg: ZooConfig | None, *, producers: int = 2, replicas: int = 2, tp: int = 2,
                 transport: str = "tcp", lookahead: int = 1, max_chunk_bytes: int = 1 << 20, timeout_s: float = 60.0,
                 spec: dict | None = None, external_consumers: int = 0, baseline: bool = False,
                 lease_s: float = 10.0, min_consumers: int | None = None, join_grace_s: float = 30.0,
                 verify_checksums: bool = False, producer_extra: dict | None = None,
                 consumer_extra: dict | None = None):
        self.cfg, self.n_p, self.replicas, self.tp = cfg, producers, replicas, tp
        self.timeout_s, self.transport = timeout_s, transport
        self.inbox = _Inbox()
        self.token = secrets.token_hex(8)
        self.procs: dict[Any, Any] = {}
        self.cmds: dict[Any, Any] = {}
        self.args: dict[Any, tuple] = {}
        self.c = asdict(cfg) if cfg is not None else {}
        n_cons = external_consumers or replicas * tp
        base = dict(n_producers=producers, n_consumers=n_cons, token=self.token, transport=transport,
                    lookahead=lookahead, max_chunk_bytes=max_chunk_bytes, timeout_s=timeout_s, lease_s=lease_s,
                    min_consumers=min_consumers, join_grace_s=join_grace_s, verify_checksums=verify_checksums,
                    **(producer_extra or {}))
        self.ccfg = dict(transport=transport, timeout_s=timeout_s, verify_checksums=verify_checksums,
                         **(consumer_extra or {}))
        self.bl = None
        if baseline:
            import socket

            with socket.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                self.bl = {"port": sk.getsockname()[1], "world": producers + n_cons, "producers": producers}
            base["baseline"] = self.bl
        self.spec = spec or {"kind": "zoo", "cfg": self.c}
        self.ccfg["check_spec"] = self.spec
        self._start(producer_main, (0, producers, self.spec, dict(base, rank=0)), 0)
        coord = self._expect("address", {0})[0]
        self.pcfg = dict(base, coordinator=coord)
        for r in range(1, producers):
            self._start(producer_main, (r, producers, self.spec, dict(self.pcfg, rank=r)), r)
        self._expect("address", set(range(1, producers)))
        self.coordinator = coord
        self.consumer_ids: list[str] = []
        if external_consumers:
            return
        self.consumer_ids = [f"r{i}/tp{t}" for i in range(replicas) for t in range(tp)]
        for cid in self.consumer_ids:
            self._start_consumer(cid)
        self.wait_ready()

    def _start_consumer(self, cid: str) -> None:
        t = int(cid.split("tp")[1])
        cbl = None if self.bl is None else dict(self.bl, rank=self.n_p + self.consumer_ids.index(cid))
        self._start(consumer_main, (cid, self.tp, t, self.c, self.coordinator, self.token, self.ccfg), cid, cbl)

    def wait_ready(self) -> list[Any]:
        self.init_stats = self._expect("ready", set(range(self.n_p)) | set(self.consumer_ids))
        return self.init_stats

    def _start(self, fn, args, key, *extra) -> None:
        """The child's command queue, ``extra`` and its result pipe are appended to ``args``."""
        q = _CTX.Queue()
        r, w = _CTX.Pipe(duplex=False)
        p = _CTX.Process(target=fn, args=(*args, q, *extra, w), daemon=True)
        p.start()
        w.close()  # the child holds the write end now
        self.inbox.add(key, r, p.sentinel)
        self.inbox.died.pop(key, None)
        self.procs[key], self.cmds[key], self.args[key] = p, q, (fn, args, extra)

    # ------------------------------------------------------------------ faults
    def kill(self, key: Any) -> float:
        """SIGKILL one producer (by rank) or consumer (by id); returns when it happened (time.time())."""
        t = time.time()
        self.procs[key].kill()
        self.procs[key].join(5)
        self.inbox.forget(key, t)
        self.cmds.pop(key, None)
        return t

    def pause(self, key: Any) -> float:
        t = time.time()
        os.kill(self.procs[key].pid, signal.SIGSTOP)
        return t

    def resume(self, key: Any) -> None:
        os.kill(self.procs[key].pid, signal.SIGCONT)

    def restart(self, key: Any) -> Any:
        """A new process for a dead consumer (same id: it rejoins) or producer (same rank and coordinator)."""
        if self.procs[key].is_alive():
            self.kill(key)
        else:
            self.inbox.forget(key, self.inbox.died.get(key, time.time()))
        if isinstance(key, int):
            if key == 0:
                raise ValueError("producer 0 hosts the coordinator: restart the whole group instead")
            self._start(producer_main, (key, self.n_p, self.spec, dict(self.pcfg, rank=key)), key)
            self._expect("address", {key})
        else:
            self._start_consumer(key)
        return self._expect("ready", {key})[0]

    def alive(self) -> list[Any]:
        return [k for k, p in self.procs.items() if p.is_alive() and k in self.cmds]

    # ------------------------------------------------------------------ runs
    def _expect(self, kind: str, keys: set, *, tolerate_death: bool = False) -> list[Any]:
        got: dict[Any, Any] = {}
        wait = 600.0 if kind in ("address", "ready") else self.timeout_s * 3 + 60
        deadline = time.monotonic() + wait
        while keys - got.keys():
            dead = {k for k in keys - got.keys() if k in self.inbox.died or not self.procs[k].is_alive()}
            if dead:
                if not tolerate_death:
                    raise RuntimeError(f"local cluster: {sorted(map(str, dead))} died while {kind!r} was awaited")
                for k in dead:
                    got[k] = None
                    self.cmds.pop(k, None)
                continue
            try:
                k, who, payload = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"local cluster: no {kind!r} from {sorted(map(str, keys - got.keys()))}") from None
            if k == "error":
                raise RuntimeError(payload)
            if k == kind and who in keys:
                got[who] = payload
        return [got[k] for k in sorted(got, key=str)]

    def sync(self, version: int, *, baseline: bool = False, faults: dict[Any, dict] | None = None,
             tolerate: bool = False) -> dict[str, Any]:
        """One sync through shardsync (or, ``baseline=True``, through the broadcast baseline). A failed sync on
        any process raises unless ``tolerate`` (then failures and deaths are in the report); every consumer
        still alive afterwards is checked."""
        faults = faults or {}
        producers = [k for k in self.alive() if isinstance(k, int)]
        consumers = [k for k in self.alive() if not isinstance(k, int)]
        for k in producers:
            self.cmds[k].put(("prepare", version))
        self._expect("prepared", set(producers))
        for k in producers + consumers:
            self.cmds[k].put(("baseline" if baseline else "sync", version, faults.get(k)))
        res = dict(zip(sorted(producers + consumers, key=str),
                       self._expect("synced", set(producers + consumers), tolerate_death=True)))
        failed = {k: (r or {}).get("error", "died") for k, r in res.items() if r is None or "error" in r}
        if failed and not tolerate:
            raise RuntimeError(f"sync {version} failed: " + "; ".join(f"{k}: {e}" for k, e in sorted(
                failed.items(), key=lambda x: str(x[0]))))
        checked = [k for k in consumers if k in self.alive()]
        for k in checked:
            self.cmds[k].put(("check", version))
        states = dict(zip(sorted(checked, key=str), self._expect("checked", set(checked), tolerate_death=True)))
        cons = []
        for k in sorted(consumers, key=str):
            r, s = res.get(k), states.get(k)
            entry = dict(r or {"error": "died"}, consumer=k, state=s)
            ok = r is not None and "error" not in r and s is not None and s["version"] == version
            entry["mismatched"] = (s or {}).get("mismatched", [])
            entry["exact"] = ok and not entry["mismatched"]
            cons.append(entry)
        return {"version": version, "producers": [res.get(k) for k in sorted(producers)], "consumers": cons,
                "failed": {str(k): e for k, e in failed.items()},
                "exact": all(c["exact"] for c in cons) and not failed}

    def close(self) -> None:
        for q in self.cmds.values():
            q.put(None)
        for p in self.procs.values():
            try:
                os.kill(p.pid, signal.SIGCONT)  # a paused child cannot exit
            except (OSError, TypeError):
                pass
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
