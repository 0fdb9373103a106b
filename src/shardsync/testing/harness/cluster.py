"""Run producers and consumers as real processes on this machine (tests, ``demo``, ``bench``, ``chaos``).

Producers hold a pipeline-parallel share of a zoo model's layers (rank 0 also ``pre``, the last rank ``post``);
consumers are ``replicas × tp`` loader-zoo models with vLLM loader semantics. Each is a process host
(``hosts.Hosted``) of a ``cluster_procs`` object. Every sync the trainer's weights change (seed = version); each
consumer then compares its parameters, byte for byte, with its own loaders run on the full tensors of the version
it says it holds — or says it is torn and serves nothing::

    with LocalCluster(ZooConfig.qwen3_moe_tiny(), producers=2, replicas=2, tp=2, transport="tcp") as cl:
        for v in (1, 2, 3):
            report = cl.sync(v)      # {"producers": [...], "consumers": [...]} with "exact" per consumer

Faults are real: :meth:`kill` (SIGKILL), :meth:`pause`/:meth:`resume` (SIGSTOP/SIGCONT), :meth:`restart` (a new
process with the same id or rank), and per-sync ``faults`` that make a child kill itself at a given chunk, group or
apply (see ``cluster_procs``). :meth:`died_at` says when a death was seen (the moment it happened: every wait
watches every child).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict
from typing import Any

from ..zoo import ZooConfig
from .hosts import Hosted, HostedDied, HostedError, free_port, results

__all__ = ["LocalCluster"]
PROCS = "shardsync.testing.harness.cluster_procs"


class LocalCluster:
    """``mac=True``: the producers tag chunks and MAC control frames (``ProducerConfig.mac``), the consumers require
    it. ``external_consumers=N`` starts only the producers (and a coordinator expecting N consumers, e.g.
    vLLM workers started by the caller): call :meth:`wait_ready` once those have initialised. ``baseline=True``:
    the processes also join the broadcast baseline's world (``sync(v, baseline=True)``). ``delta=True``: delta sync
    on every producer and consumer (``ProducerConfig.delta``, ``Consumer(delta=True)``); with a ``spec`` carrying
    ``changed`` (a fraction) each version changes only that fraction of the elements (``trainers.sparse_steps``)."""

    def __init__(self, cfg: ZooConfig | None, *, producers: int = 2, replicas: int = 2, tp: int = 2,
                 transport: str = "tcp", lookahead: int = 1, max_chunk_bytes: int = 1 << 20, timeout_s: float = 60.0,
                 spec: dict | None = None, external_consumers: int = 0, baseline: bool = False,
                 lease_s: float = 10.0, min_consumers: int | None = None, join_grace_s: float = 30.0,
                 verify_checksums: bool | None = None, producer_extra: dict | None = None,
                 consumer_extra: dict | None = None, mac: bool = False, delta: bool = False):
        self.cfg, self.n_p, self.replicas, self.tp = cfg, producers, replicas, tp
        self.timeout_s, self.transport = timeout_s, transport
        self.token = secrets.token_hex(8)
        self.hosts: dict[Any, Hosted] = {}
        self.died: dict[Any, float] = {}
        self.c = asdict(cfg) if cfg is not None else {}
        n_cons = external_consumers or replicas * tp
        self.pcfg = dict(n_consumers=n_cons, token=self.token, transport=transport, lookahead=lookahead,
                         max_chunk_bytes=max_chunk_bytes, timeout_s=timeout_s, lease_s=lease_s,
                         min_consumers=min_consumers, join_grace_s=join_grace_s, verify_checksums=verify_checksums,
                         mac=mac, **({"delta": True} if delta else {}), **(producer_extra or {}))
        self.spec = spec or {"kind": "zoo", "cfg": self.c}
        self.ccfg = dict(transport=transport, timeout_s=timeout_s, verify_checksums=bool(verify_checksums),
                         require_mac=mac, check_spec=self.spec, **({"delta": True} if delta else {}),
                         **(consumer_extra or {}))
        self.bl = None
        if baseline:
            self.bl = {"port": free_port(), "world": producers + n_cons, "producers": producers}
        self.inits: dict[Any, Any] = {}  # pending init calls, collected by wait_ready()
        self.coordinator: list | None = None
        self.addresses: dict[int, list] = {}  # producer rank -> its control address
        self.coordinator = self._start_producers([0])[0]
        self._start_producers(list(range(1, producers)))
        self.consumer_ids: list[str] = []
        if external_consumers:
            return
        self.consumer_ids = [f"r{i}/tp{t}" for i in range(replicas) for t in range(tp)]
        self._start_consumers(self.consumer_ids)
        self.wait_ready()

    # ------------------------------------------------------------------ processes
    def _spawn(self, kind: str, kwargs: dict[Any, dict]) -> None:
        """One child per key (replacing any earlier one), all at once; returns once every constructor has; then
        each child's init call is sent (``inits``)."""
        for key, kw in kwargs.items():
            self.hosts[key] = Hosted(str(key), f"{PROCS}:{kind}", kw, daemon=True)
            self.died.pop(key, None)
        self._expect({k: self.hosts[k].constructor for k in kwargs}, "start")

    def _start_producers(self, ranks: list[int]) -> list[list]:
        """Producer processes, listening (their inits wait for the consumers); their addresses."""
        self._spawn("TrainerProc", {r: dict(spec=self.spec, rank=r, n=self.n_p, baseline=self.bl,
                                            pcfg=dict(self.pcfg, coordinator=self.coordinator)) for r in ranks})
        addrs = self._expect({r: self.hosts[r].call("address") for r in ranks}, "address")
        self.addresses.update(zip(ranks, addrs))
        self.inits.update({r: self.hosts[r].call("init") for r in ranks})
        return addrs

    def _start_consumers(self, cids: list[str]) -> None:
        def bl(cid: str) -> dict | None:
            return None if self.bl is None else dict(self.bl, rank=self.n_p + self.consumer_ids.index(cid))

        self._spawn("ConsumerProc", {c: dict(cid=c, cfg=self.c, tp=self.tp, tp_rank=int(c.split("tp")[1]),
                                             coordinator=self.coordinator, token=self.token, ccfg=self.ccfg,
                                             baseline=bl(c)) for c in cids})
        self.inits.update({c: self.hosts[c].call("init") for c in cids})

    def wait_ready(self) -> list[Any]:
        """Every child's init stats, once every one has initialised (producers: every consumer registered)."""
        calls, self.inits = self.inits, {}
        self.init_stats = self._expect(calls, "ready")
        return self.init_stats

    # ------------------------------------------------------------------ faults
    def kill(self, key: Any) -> float:
        """SIGKILL one producer (by rank) or consumer (by id); returns when it happened (time.time())."""
        t = self.hosts[key].kill()
        self.died[key] = t
        return t

    def pause(self, key: Any) -> float:
        return self.hosts[key].pause()

    def resume(self, key: Any) -> None:
        self.hosts[key].resume()

    def died_at(self, key: Any) -> float | None:
        """When ``key``'s process was killed or seen dead (``time.time()``); None while its current process lives."""
        h = self.hosts.get(key)
        return self.died.get(key) or (h.died_at if h is not None else None)

    def restart(self, key: Any) -> Any:
        """A new process for a dead consumer (same id: it rejoins) or producer (same rank and coordinator)."""
        if self.hosts[key].alive():
            self.kill(key)
        if isinstance(key, int):
            if key == 0:
                raise ValueError("producer 0 hosts the coordinator: restart the whole group instead")
            self._start_producers([key])
        else:
            self._start_consumers([key])
        return self._expect({key: self.inits.pop(key)}, "ready")[0]

    @property
    def procs(self) -> dict[Any, Any]:
        """The child processes (``multiprocessing.Process``), by rank or consumer id."""
        return {k: h.proc for k, h in self.hosts.items()}

    def alive(self) -> list[Any]:
        return [k for k, h in self.hosts.items() if h.alive() and k not in self.died]

    # ------------------------------------------------------------------ runs
    def _expect(self, calls: dict[Any, Any], what: str, *, tolerate_death: bool = False) -> list[Any]:
        """Each call's result (sorted by key); a death raises unless ``tolerate_death`` (then None, and the child
        counts as dead); an error in a child raises."""
        wait = 600.0 if what in ("start", "address", "ready") else self.timeout_s * 3 + 60
        got = results(calls, wait)
        out = {}
        for k, v in got.items():
            if isinstance(v, HostedDied):
                self.died.setdefault(k, self.hosts[k].died_at or time.time())
                if not tolerate_death:
                    raise RuntimeError(f"local cluster: {k} died while {what!r} was awaited")
                out[k] = None
            elif isinstance(v, HostedError):
                raise RuntimeError(str(v))
            elif isinstance(v, TimeoutError):
                missing = sorted(str(k) for k, v in got.items() if isinstance(v, TimeoutError))
                raise TimeoutError(f"local cluster: no {what!r} from {missing}")
            else:
                out[k] = v
        return [out[k] for k in sorted(out, key=str)]

    def sync(self, version: int, *, baseline: bool = False, faults: dict[Any, dict] | None = None,
             tolerate: bool = False, skip: Any = ()) -> dict[str, Any]:
        """One sync through shardsync (or, ``baseline=True``, through the broadcast baseline). A failed sync on
        any process raises unless ``tolerate`` (then failures and deaths are in the report); every consumer
        still alive afterwards is checked. ``skip``: processes not asked (a paused one would never answer)."""
        faults = faults or {}
        producers = sorted(k for k in self.alive() if isinstance(k, int) and k not in skip)
        consumers = [k for k in self.alive() if not isinstance(k, int) and k not in skip]
        self._expect({k: self.hosts[k].call("prepare", version) for k in producers}, "prepared")
        calls = {k: (self.hosts[k].call("baseline", version) if baseline else
                     self.hosts[k].call("sync", version, faults.get(k))) for k in producers + consumers}
        res = dict(zip(sorted(calls, key=str), self._expect(calls, "synced", tolerate_death=True)))
        failed = {k: (r or {}).get("error", "died") for k, r in res.items() if r is None or "error" in r}
        if failed and not tolerate:
            raise RuntimeError(f"sync {version} failed: " + "; ".join(f"{k}: {e}" for k, e in sorted(
                failed.items(), key=lambda x: str(x[0]))))
        checked = {k: self.hosts[k].call("check", version) for k in consumers if k in self.alive()}
        states = dict(zip(sorted(checked, key=str), self._expect(checked, "checked", tolerate_death=True)))
        cons = []
        for k in sorted(consumers, key=str):
            r, s = res.get(k), states.get(k)
            entry = dict(r or {"error": "died"}, consumer=k, state=s)
            ok = r is not None and "error" not in r and s is not None and s["version"] == version
            entry["mismatched"] = (s or {}).get("mismatched", [])
            entry["exact"] = ok and not entry["mismatched"]
            cons.append(entry)
        return {"version": version, "producers": [res.get(k) for k in producers], "consumers": cons,
                "failed": {str(k): e for k, e in failed.items()},
                "exact": all(c["exact"] for c in cons) and not failed}

    def close(self) -> None:
        for h in self.hosts.values():  # all at once: each closes its producer or consumer, then exits
            if h.alive():
                h.resume()  # a paused child cannot exit
                h.cmd.put(None)
        for h in self.hosts.values():
            h.proc.join(10)
            h.kill()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
