"""``shardsync chaos``: random real faults while syncs go on, every sync checked byte for byte.

Producers (PP shares) and zoo consumers (``replicas × tp``) run as real processes (``harness.cluster``).
Before each sync one fault is drawn:

=====================  ================================================================================
kind                   what happens (all real: SIGKILL / SIGSTOP of a process, hostile bytes on a socket)
=====================  ================================================================================
``kill_between``       a consumer is killed between syncs; it is restarted (same id) after the next sync
``kill_mid_pull``      a consumer kills itself after a random number of chunk reads of this sync
``kill_mid_apply``     a consumer kills itself in the middle of applying a random group
``pause``              a consumer is SIGSTOPped past its lease for one sync, then resumed (it rejoins)
``producer_kill``      producer 1 kills itself after gathering a random group; restarted after the sync
``restart``            a consumer is killed and restarted at once (same id: replaces its old session)
``straggler``          a live consumer stops pulling (never asked to sync, or hung after a random chunk read past
                       ``straggler_s``) while its heartbeat keeps its lease: it is dropped from that version only,
                       every other consumer completes it, and it is exact at its next sync
``forged_plan``        a peer with the token registers plans with a non-allow-listed op / out-of-bounds view
``wrong_token``        a peer connects with a wrong token
``oversized_frame``    a peer announces a 4 GiB control frame
=====================  ================================================================================

After every sync each live consumer reports the version it holds (or that it is torn and refuses to
serve) and compares its bytes with the trainer's weights of that version. Counted: ``mismatched`` (a
consumer that completed a sync but holds other bytes), ``torn_served`` (one that is not torn by its own
account but holds a mix), ``deadlocks`` (a sync that did not finish within its bounds), detection time
of deaths, and rejoiners exact at their next sync.

``--vllm`` (``run_chaos_vllm``): the same with REAL vLLM engines. Producer processes (PP shares of a tiny
checkpoint) serve vLLM replicas (``harness.vllm_replica``), each hosted in a child process of its own process group
(so a fault kills the whole engine: driver, engine core, workers — kill -9). Faults, drawn in turn:

- ``engine_kill``: a replica is killed between syncs; the next sync completes on the survivor, exact;
  the replica is then restarted under the same name, rejoins, and is exact at its next sync;
- ``engine_kill_mid_sync``: a replica is killed while a sync is in flight (same checks);
- ``producer_kill``: producer 1 dies mid-sync; every engine's update fails with ``ProducerLost``; an
  engine that applied groups is torn and must refuse to generate; producer 1 is restarted and the next
  sync heals every engine;
- ``straggler``: a live replica is not driven for one version (its lease stays live: a framework still busy
  generating on it): it is dropped from that version as a straggler, the other completes it exact, and the
  straggler, still exactly on its earlier version, catches up at the next sync;
- ``trainer_restart``: the whole trainer (every producer, the coordinator with them) dies mid-sync; a new trainer
  (new processes, a new address and session, resuming after the step it names) initialises the running engines:
  each is taken over once the dead session's lease lapsed, and the new session's first sync heals every engine
  (``trainer_restarts_healed``: every engine complete and exact at it).

After each sync every live engine either refuses to serve (torn, by its own account) or is compared
with a FRESH engine started on the weights of the version it says it holds: every tensor after
processing, probe outputs, greedy tokens.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from ..testing.harness.attacks import BOUNDED, release, wire_attack
from ..testing.harness.cluster import LocalCluster
from ..testing.harness.hosts import Hosted, HostedDied
from ..verify.output import emit_json
from ..testing.zoo import ZooConfig

KINDS = ("kill_between", "kill_mid_pull", "kill_mid_apply", "pause", "producer_kill", "restart", "straggler",
         "forged_plan", "wrong_token", "oversized_frame", *BOUNDED)
CONSUMER_KINDS = {"kill_between", "kill_mid_pull", "kill_mid_apply", "pause", "restart"}
VLLM_KINDS = ("engine_kill", "engine_kill_mid_sync", "producer_kill", "straggler", "trainer_restart")
ENGINE = "shardsync.testing.harness.vllm_replica:VllmEngine"


class _Tally:
    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter()
        self.syncs = self.completed = self.deadlocks = self.torn_served = self.mismatched = 0
        self.refused_torn = self.rejoined_exact = self.rejoined_mismatched = self.unexpected = 0
        self.detect: list[float] = []
        self.lost_bytes = 0
        self.straggler_versions = self.straggler_healthy_complete = 0
        """Versions a straggler was dropped from; of those, the ones every other live consumer completed exact."""
        self.notes: list[str] = []


def run_chaos(*, kills: int = 20, seed: int = 0, producers: int = 2, replicas: int = 2, tp: int = 2,
              lease_s: float = 2.0, kinds: tuple[str, ...] = KINDS, as_json: bool = False,
              cfg: ZooConfig | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    cfg = cfg or ZooConfig.qwen3_moe_tiny(layers=4)
    t_start = time.monotonic()
    tally = _Tally()
    rejoining: set[str] = set()
    straggler_s = 2 * lease_s
    with LocalCluster(cfg, producers=producers, replicas=replicas, tp=tp, lease_s=lease_s, timeout_s=8 * lease_s,
                      max_chunk_bytes=32 << 10, verify_checksums=True,
                      producer_extra={"straggler_s": straggler_s}) as cl:
        n_reads = 6  # every consumer reads at least one chunk per group (pre, 4 layers, post)
        v = 0
        first = rng.sample(kinds, len(kinds))  # every kind once (in a random order) where the kills allow
        for i in range(kills):
            kind = first[i] if i < len(first) else rng.choice(kinds)
            tally.by_kind[kind] += 1
            v += 1
            cons = [k for k in cl.alive() if not isinstance(k, int)]
            victim = rng.choice(cons)
            faults: dict[Any, dict] = {}
            t_fault = None
            after: list[Any] = []
            skip: set[Any] = set()
            if kind == "kill_between":
                t_fault = cl.kill(victim)
                after = [("restart", victim)]
            elif kind == "kill_mid_pull":
                faults[victim] = {"die_at_chunk": rng.randint(1, n_reads)}
                after = [("restart", victim)]
            elif kind == "kill_mid_apply":
                faults[victim] = {"die_at_apply": rng.randint(1, 5)}
                after = [("restart", victim)]
            elif kind == "pause":  # stopped past its lease, resumed while the others finish the sync
                t_fault = cl.pause(victim)
                threading.Timer(3 * lease_s, cl.resume, (victim,)).start()
                rejoining.add(victim)
            elif kind == "producer_kill":
                victim = producers - 1
                faults[victim] = {"die_after_groups": rng.randint(1, 3)}
                after = [("restart", victim)]
            elif kind == "restart":
                cl.kill(victim)
                cl.restart(victim)
                rejoining.add(victim)
            elif kind == "straggler":  # alive, lease renewed, not pulling: idle all sync, or hung mid-pull
                if rng.random() < 0.5:
                    skip.add(victim)
                else:
                    faults[victim] = {"stall_at_chunk": rng.randint(1, n_reads), "stall_s": 3 * straggler_s}
                rejoining.add(victim)
            else:  # an attack on the wire: every consumer must complete the sync beside it
                victim = None
                tally.notes.append(f"v{v} {kind}: " + wire_attack(
                    kind, cl.coordinator, cl.token, peers=[cl.addresses[r] for r in range(1, producers)],
                    victims=[k for k in cl.alive() if not isinstance(k, int)], version=v))
            try:
                r = cl.sync(v, faults=faults, tolerate=True, skip=skip)
            except TimeoutError as e:
                tally.deadlocks += 1
                tally.notes.append(f"v{v} {kind}: DEADLOCK {e}")
                print(tally.notes[-1], file=sys.stderr)
                break
            tally.syncs += 1
            _score(tally, r, kind, victim, t_fault, cl, rejoining)
            print(f"sync {v:3d} {kind:16s} victim {str(victim):7s} completed "
                  f"{sum(c['exact'] for c in r['consumers'])}/{len(r['consumers'])} consumers"
                  + (f"; failed: {sorted(r['failed'])}" if r["failed"] else ""), file=sys.stderr)
            for _, key in after:
                cl.restart(key)
                if not isinstance(key, int):
                    rejoining.add(key)
        release()  # the last flood's sockets
        # a last clean sync: every rejoiner must be exact
        v += 1
        r = cl.sync(v, tolerate=True)
        tally.syncs += 1
        _score(tally, r, "final", None, None, cl, rejoining)
    out = {"faults": sum(tally.by_kind.values()), "by_kind": dict(tally.by_kind), "syncs": tally.syncs,
           "syncs_completed": tally.completed, "deadlocks": tally.deadlocks, "torn_served": tally.torn_served,
           "mismatched": tally.mismatched, "rejoined_exact": tally.rejoined_exact,
           "rejoined_mismatched": tally.rejoined_mismatched, "refused_torn": tally.refused_torn,
           "unexpected_failures": tally.unexpected, "max_detect_s": round(max(tally.detect, default=0.0), 3),
           "lease_s": lease_s, "lost_bytes": tally.lost_bytes, "straggler_versions": tally.straggler_versions,
           "straggler_healthy_complete": tally.straggler_healthy_complete,
           "seconds": round(time.monotonic() - t_start, 1)}
    _print_table(out, tally, as_json)
    return out


def _score(t: _Tally, r: dict, kind: str, victim: Any, t_fault: float | None, cl: LocalCluster,
           rejoining: set[str]) -> None:
    ok_consumers = 0
    for c in r["consumers"]:
        s = c["state"]
        if s is None:
            continue  # dead: serves nothing
        if s["torn"]:
            t.refused_torn += 1
        elif s["version"] and s["mismatched"]:
            if "error" in c:
                t.torn_served += 1
            else:
                t.mismatched += 1
        if "error" not in c:
            ok_consumers += 1
            if c["consumer"] in rejoining:
                rejoining.discard(c["consumer"])
                if c["exact"]:
                    t.rejoined_exact += 1
                else:
                    t.rejoined_mismatched += 1
        elif kind != "producer_kill" and c["consumer"] != victim and c["consumer"] not in rejoining:
            t.unexpected += 1  # a bystander failed a sync it should have completed
            t.notes.append(f"v{r['version']} {kind}: {c['consumer']} failed: {c['error'][:600]}")
            print("UNEXPECTED " + t.notes[-1], file=sys.stderr)
    if not r["failed"]:
        t.completed += 1
    for p in r["producers"]:
        if p is None:
            continue
        t.lost_bytes += p.get("held_bytes", 0)
        if kind == "straggler" and "straggler" not in p.get("dropped", {}).get(victim, "straggler"):
            t.unexpected += 1  # the straggler must be dropped as one (or have completed in time)
            t.notes.append(f"v{r['version']} straggler {victim}: dropped as {p['dropped'][victim][:300]}")
        if kind in CONSUMER_KINDS and "dropped_at" in p and victim in p["dropped_at"]:
            t0 = t_fault if t_fault is not None else cl.died_at(victim)
            if t0 is not None:
                t.detect.append(p["dropped_at"][victim] - t0)
    if kind == "straggler" and any(victim in (p or {}).get("dropped", {}) for p in r["producers"]):
        t.straggler_versions += 1
        others = [c for c in r["consumers"] if c["consumer"] != victim and c["state"] is not None]
        if all(c["exact"] for c in others):
            t.straggler_healthy_complete += 1
        else:
            t.notes.append(f"v{r['version']} straggler {victim}: a healthy consumer did not complete")
    if kind == "producer_kill":
        t0 = cl.died_at(victim)
        errs = [c.get("t") for c in r["consumers"] if c.get("t")]
        if t0 is not None and errs:
            t.detect.append(max(errs) - t0)


def _print_table(out: dict, t: _Tally, as_json: bool) -> None:
    f = sys.stderr if as_json else sys.stdout
    print(f"{'fault kind':18s} count", file=f)
    for k, n in sorted(out["by_kind"].items()):
        print(f"{k:18s} {n:5d}", file=f)
    for k in ("syncs", "syncs_completed", "deadlocks", "torn_served", "mismatched", "rejoined_exact",
              "rejoined_mismatched", "refused_torn", "unexpected_failures", "max_detect_s", "lost_bytes",
              "straggler_versions", "straggler_healthy_complete", "seconds"):
        print(f"{k:26s} {out[k]}", file=f)
    for n in t.notes[-12:]:
        print("  " + n[:400], file=f)
    if as_json:
        emit_json(out)


# ------------------------------------------------------------------ --vllm: real vLLM engines
def _engine(name: str, ckpt: str, info: dict) -> Hosted:
    """A replica: the harness's vLLM engine in a process (group) of its own, up and registered."""
    h = Hosted(name, ENGINE, dict(model_dir=ckpt, name=name, **info))
    h.ready(600)
    return h


def _answer(call: Any, timeout: float) -> Any:
    """The call's result; None if the engine died before answering."""
    try:
        return call.result(timeout)
    except HostedDied:
        return None


def _trainer(ckpt: str, lease_s: float) -> LocalCluster:
    """The trainer: two producer processes (PP shares of ``ckpt``), producer 0 the coordinator of two engines."""
    return LocalCluster(None, producers=2, spec={"kind": "checkpoint", "path": ckpt}, external_consumers=2,
                        lease_s=lease_s, timeout_s=120)


def run_chaos_vllm(*, kills: int = 3, seed: int = 0, lease_s: float = 3.0, arch: str = "qwen3",
                   kinds: tuple[str, ...] = VLLM_KINDS, as_json: bool = False,
                   workdir: str | None = None) -> dict[str, Any]:
    from ..verify.checkpoints import build_tiny_checkpoint
    from ..testing.harness.vllm_replica import FreshReferences

    rng = random.Random(seed)
    work = workdir or tempfile.mkdtemp(prefix="shardsync-chaos-vllm-")
    ckpt = build_tiny_checkpoint(arch, os.path.join(work, arch))
    fresh = FreshReferences(ckpt, work)
    t_start = time.monotonic()
    cl = _trainer(ckpt, lease_s)
    session = "chaos-0"  # the trainer's session id (``info`` reads it, and ``cl``, as they are at each call)
    info = lambda n: {"coordinator": cl.coordinator, "token": cl.token, "session": session,  # noqa: E731
                      "plan_dir": os.path.join(work, n), "timeout_s": 120}
    reps: dict[str, Hosted] = {}
    tally: dict[str, Any] = {"faults": 0, "by_kind": {}, "syncs": 0, "syncs_completed": 0, "deadlocks": 0,
                             "torn_served": 0, "mismatched": 0, "refused_torn": 0, "rejoined_exact": 0,
                             "compared": 0, "straggler_versions": 0, "straggler_healthy_complete": 0,
                             "trainer_restarts": 0, "trainer_restarts_healed": 0, "takeover_s": 0.0, "notes": []}
    rejoining: set[str] = set()
    resumed = False  # the last step restarted the trainer: this sync must heal every engine
    try:
        booting = {n: Hosted(n, ENGINE, dict(model_dir=ckpt, name=n, **info(n))) for n in ("r0", "r1")}
        reps.update(booting)  # closed in any case
        for r in booting.values():
            r.ready(600)
        cl.wait_ready()
        v, last_s = 0, 2.0
        for i in range(kills + 1):
            kind = kinds[i % len(kinds)] if i < kills else "final"
            if kind != "final":
                tally["faults"] += 1
                tally["by_kind"][kind] = tally["by_kind"].get(kind, 0) + 1
            v += 1
            victim = rng.choice(sorted(reps))
            faults: dict[Any, dict] = {}
            idle: set[str] = set()
            if kind == "engine_kill":
                reps[victim].kill()
            elif kind == "engine_kill_mid_sync":  # within the span the last sync took
                threading.Timer(rng.uniform(0.1, 0.6) * last_s, reps[victim].kill).start()
            elif kind == "producer_kill":
                faults = {1: {"die_after_groups": 1}}
            elif kind == "straggler":  # registered, lease live, not driven this step
                idle.add(victim)
            elif kind == "trainer_restart":  # every producer dies mid-sync (the coordinator with producer 0)
                faults = {0: {"die_after_groups": 1}, 1: {"die_after_groups": 1}}
            live = [r for r in reps.values() if r.alive() and r.name not in idle]
            t_sync = time.monotonic()
            calls = {r.name: r.call("sync", v) for r in live}
            try:
                res = cl.sync(v, faults=faults, tolerate=True)
                synced = {n: _answer(c, 300) for n, c in calls.items()}
            except TimeoutError as e:
                tally["deadlocks"] += 1
                tally["notes"].append(f"v{v} {kind}: DEADLOCK {e}")
                break
            tally["syncs"] += 1
            last_s = time.monotonic() - t_sync
            ok = {n for n, s in synced.items() if s is not None and s["error"] is None}
            if not res["failed"] and len(ok) == len(synced):
                tally["syncs_completed"] += 1
            mismatched_before = tally["mismatched"] + tally["torn_served"]
            if idle and all(any(c.startswith(victim + "/") and "straggler" in why  # its workers: "r1/rank0"
                                for c, why in (p or {}).get("dropped", {}).items()) for p in res["producers"]):
                tally["straggler_versions"] += 1
                tally["straggler_healthy_complete"] += not res["failed"] and len(ok) == len(synced) > 0
            _check_engines(tally, v, kind, reps, fresh, work, rejoining, ok)
            if resumed:  # the new trainer session's first sync: every engine complete and exact
                resumed = False
                tally["trainer_restarts_healed"] += (ok == set(reps) and not res["failed"]
                                                     and tally["mismatched"] + tally["torn_served"]
                                                     == mismatched_before)
            print(f"sync {v}: {kind:22s} victim {victim}: engines completed {sorted(ok)}; producers failed "
                  f"{sorted(res['failed'])}", file=sys.stderr)
            if kind == "trainer_restart":
                cl.close()  # what is left of the dead trainer
                session = f"chaos-{v}"
                cl = _trainer(ckpt, lease_s)  # a new address: the engines' old owner never answers again
                t0 = time.monotonic()
                inits = {n: r.call("init", start_version=v, **info(n)) for n, r in reps.items() if r.alive()}
                cl.wait_ready()  # each engine's init returns once the old session's lease lapsed there
                for n, c in inits.items():
                    c.result(300)  # an engine that refused the new trainer fails the run here
                tally["trainer_restarts"] += 1
                tally["takeover_s"] = round(max(tally["takeover_s"], time.monotonic() - t0), 2)
                rejoining.update(inits)
                resumed = True
            for n, r in list(reps.items()):  # restart what died, as a framework would
                if not r.alive():
                    r.kill()
                    reps[n] = _engine(n, ckpt, info(n))
                    rejoining.add(n)
            if kind == "producer_kill":
                cl.restart(1)
    finally:
        for r in reps.values():
            r.close(30)
        cl.close()
        shutil.rmtree(work, ignore_errors=True) if workdir is None else None
    out = {k: tally[k] for k in ("faults", "by_kind", "syncs", "syncs_completed", "deadlocks", "torn_served",
                                 "mismatched", "refused_torn", "rejoined_exact", "compared", "straggler_versions",
                                 "straggler_healthy_complete", "trainer_restarts", "trainer_restarts_healed",
                                 "takeover_s")}
    out["seconds"] = round(time.monotonic() - t_start, 1)
    f = sys.stderr if as_json else sys.stdout
    for k, val in out.items():
        print(f"{k:18s} {val}", file=f)
    for n in tally["notes"][-10:]:
        print("  " + n[:400], file=f)
    if as_json:
        emit_json(out)
    return out


def _check_engines(tally: dict, v: int, kind: str, reps: dict[str, Hosted], fresh: Any, work: str,
                   rejoining: set[str], ok: set[str]) -> None:
    """Every live engine: refuses to serve (torn) or equals a fresh engine on the version it says it holds."""
    for n, r in reps.items():
        if not r.alive():
            continue
        st = _answer(r.call("inspect", os.path.join(work, f"inspect-v{v}-{n}")), 300)
        if st is None:
            continue
        if "refused" in st:
            tally["refused_torn"] += 1
            continue
        held = st["weight_version"]
        if held is None or not str(held).isdigit():
            continue  # never synced: its checkpoint weights, not a trainer version
        n_keys, bad = fresh.compare(int(held), st)
        tally["compared"] += n_keys
        if bad:
            tally["mismatched" if n in ok else "torn_served"] += 1
            tally["notes"].append(f"v{v} {kind}: {n} holds version {held} but differs: {bad[:3]}")
        elif n in rejoining and n in ok:
            rejoining.discard(n)
            tally["rejoined_exact"] += 1


def run(args) -> int:
    """``shardsync chaos [--vllm]``: 1 if any sync deadlocked, served torn weights or mismatched (2: bad kinds)."""
    known = VLLM_KINDS if args.vllm else KINDS
    kinds = tuple(k for k in args.kinds.split(",") if k) or known
    unknown = set(kinds) - set(known)
    if unknown:
        print(f"shardsync chaos{' --vllm' if args.vllm else ''}: unknown fault kinds {sorted(unknown)}; known: "
              f"{list(known)}" + ("" if args.vllm or not unknown <= set(VLLM_KINDS) else
                                  f"; {sorted(unknown)} need --vllm (real vLLM engines)"), file=sys.stderr)
        return 2
    if args.vllm:
        r = run_chaos_vllm(kills=args.kills, seed=args.seed, lease_s=max(args.lease, 3.0), kinds=kinds,
                           as_json=args.json)
        return 1 if r["deadlocks"] or r["torn_served"] or r["mismatched"] or \
            r["straggler_healthy_complete"] != r["straggler_versions"] or \
            r["trainer_restarts_healed"] != r["trainer_restarts"] else 0
    r = run_chaos(kills=args.kills, seed=args.seed, lease_s=args.lease, kinds=kinds, as_json=args.json)
    bad = r["deadlocks"] or r["torn_served"] or r["mismatched"] or r["rejoined_mismatched"] or \
        r["unexpected_failures"] or r["lost_bytes"] or r["straggler_healthy_complete"] != r["straggler_versions"]
    return 1 if bad else 0
