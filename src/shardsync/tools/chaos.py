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
``forged_plan``        a peer with the token registers plans with a non-allow-listed op / out-of-bounds view
``wrong_token``        a peer connects with a wrong token
``oversized_frame``    a peer announces a 4 GiB control frame
=====================  ================================================================================

After every sync each live consumer reports the version it holds (or that it is torn and refuses to
serve) and compares its bytes with the trainer's weights of that version. Counted: ``mismatched`` (a
consumer that completed a sync but holds other bytes), ``torn_served`` (one that is not torn by its own
account but holds a mix), ``deadlocks`` (a sync that did not finish within its bounds), detection time
of deaths, and rejoiners exact at their next sync.
"""

from __future__ import annotations

import random
import socket
import struct
import sys
import threading
import time
from collections import Counter
from typing import Any

from .harness.cluster import LocalCluster
from .output import emit_json
from ..zoo import ZooConfig

KINDS = ("kill_between", "kill_mid_pull", "kill_mid_apply", "pause", "producer_kill", "restart", "forged_plan",
         "wrong_token", "oversized_frame")
FORGES = ("unknown_op", "out_of_bounds", "huge")
CONSUMER_KINDS = {"kill_between", "kill_mid_pull", "kill_mid_apply", "pause", "restart"}


def wire_attack(kind: str, coordinator: list, token: str, metadata_cid: str = "attacker") -> str:
    """One hostile peer against the coordinator; returns the typed refusal it got (raises if it was not refused)."""
    from ..engine import control as m
    from ..engine.wire import handshake_client, recv_frame
    from ..errors import AuthError, PlanError, TransportError

    if kind == "wrong_token":
        try:
            m.ControlClient(coordinator, token + "x", peer="coordinator")
        except AuthError as e:
            return f"AuthError: {e}"
        raise AssertionError("a wrong token was accepted")
    if kind == "oversized_frame":
        with socket.create_connection(tuple(coordinator), timeout=10) as s:
            handshake_client(s, token, "coordinator")
            s.sendall(struct.pack("!I", 0xFFFFFFFF))  # 4 GiB announced; no payload follows
            try:
                recv_frame(s, max_frame_bytes=1 << 20)
            except (ConnectionError, OSError):
                return "connection closed before any payload was read"
        raise AssertionError("an oversized frame was answered")
    if kind == "forged_plan":
        refusals = []
        for forge in FORGES:
            c = m.ControlClient(coordinator, token, peer="coordinator")
            try:
                w = c.call(m.Hello(consumer=f"{metadata_cid}-{forge}"), timeout_s=30)
                plan = forged_plan(w.metadata, f"{metadata_cid}-{forge}", forge)
                c.call(m.RegisterPlan(consumer=plan.consumer, session=w.session, plan=plan.to_json()), timeout_s=30)
            except PlanError as e:
                refusals.append(f"PlanError: {e}")
            except TransportError as e:
                raise AssertionError(f"forged plan ({forge}) was not refused as a plan: {e}") from None
            else:
                raise AssertionError(f"a forged plan ({forge}) was accepted")
            finally:
                try:
                    c.call(m.Goodbye(consumer=f"{metadata_cid}-{forge}", session=w.session), timeout_s=5)
                except Exception:
                    pass
                c.close()
        return " | ".join(refusals)
    raise ValueError(kind)


def forged_plan(metadata: list[dict], cid: str, forge: str):
    """A sealed plan that passes the digest check but asks for a forbidden op or an out-of-bounds view."""
    from ..types import GroupPlan, Op, ParamMeta, Plan, Scatter, StridedView, metadata_digest

    metas = [ParamMeta.from_dict(d) for d in metadata]
    src = metas[0]
    n = 1
    for d in src.shape:
        n *= d
    common = dict(src=src.name, src_dtype=src.dtype, dst="x", dst_byte_offset=0, dst_dtype=src.dtype)
    if forge == "unknown_op":  # torch.save on the trainer, by name
        s = Scatter(ops=(Op(name="save", fn=True),), view=None, shape=tuple(src.shape),
                    dst_stride=(), **common)
    elif forge == "out_of_bounds":  # a view that starts where the tensor ends
        s = Scatter(ops=(), view=StridedView(offset=n, shape=(n,), stride=(1,)), shape=(n,), dst_stride=(1,),
                    **common)
    else:  # huge: an in-bounds stride-0 view of 2^40 elements (terabytes of ring if it were believed)
        s = Scatter(ops=(), view=StridedView(offset=0, shape=(1 << 40,), stride=(0,)), shape=(1 << 40,),
                    dst_stride=(1,), **common)
    g = GroupPlan(name="pre", scatters=(s,), nbytes=0, sources=(src.name,))
    return Plan(consumer=cid, meta_digest=metadata_digest(metas), groups=(g,), unneeded=()).sealed()


class _Tally:
    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter()
        self.syncs = self.completed = self.deadlocks = self.torn_served = self.mismatched = 0
        self.refused_torn = self.rejoined_exact = self.rejoined_mismatched = self.unexpected = 0
        self.detect: list[float] = []
        self.lost_bytes = 0
        self.notes: list[str] = []


def run_chaos(*, kills: int = 20, seed: int = 0, producers: int = 2, replicas: int = 2, tp: int = 2,
              lease_s: float = 2.0, kinds: tuple[str, ...] = KINDS, as_json: bool = False,
              cfg: ZooConfig | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    cfg = cfg or ZooConfig.qwen3_moe_tiny(layers=4)
    t_start = time.monotonic()
    tally = _Tally()
    rejoining: set[str] = set()
    with LocalCluster(cfg, producers=producers, replicas=replicas, tp=tp, lease_s=lease_s, timeout_s=8 * lease_s,
                      max_chunk_bytes=32 << 10, verify_checksums=True) as cl:
        n_reads = 6  # every consumer reads at least one chunk per group (pre, 4 layers, post)
        v = 0
        for i in range(kills):
            kind = rng.choice(kinds)
            tally.by_kind[kind] += 1
            v += 1
            cons = [k for k in cl.alive() if not isinstance(k, int)]
            victim = rng.choice(cons)
            faults: dict[Any, dict] = {}
            t_fault = None
            after: list[Any] = []
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
            else:
                tally.notes.append(f"v{v} {kind}: {wire_attack(kind, cl.coordinator, cl.token)}")
            try:
                r = cl.sync(v, faults=faults, tolerate=True)
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
           "lease_s": lease_s, "lost_bytes": tally.lost_bytes, "seconds": round(time.monotonic() - t_start, 1)}
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
        if kind in CONSUMER_KINDS and "dropped_at" in p and victim in p["dropped_at"]:
            t0 = t_fault if t_fault is not None else cl.died_at(victim)
            if t0 is not None:
                t.detect.append(p["dropped_at"][victim] - t0)
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
              "rejoined_mismatched", "refused_torn", "unexpected_failures", "max_detect_s", "lost_bytes", "seconds"):
        print(f"{k:22s} {out[k]}", file=f)
    for n in t.notes[-12:]:
        print("  " + n[:400], file=f)
    if as_json:
        emit_json(out)
