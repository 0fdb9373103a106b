"""Hostile peers for the chaos runs and the wire tests: a peer with a wrong token, one announcing a 4 GiB control
frame, and one that registers forged plans (a sealed plan whose digest checks out but which asks for a
non-allow-listed op, an out-of-bounds view or terabytes of ring) — each must be refused with a typed error. And the
ones that must be bounded rather than refused: a flood of idle connections (held through the next sync), a
handshake dripped a byte at a time, a token holder's 20 MB ``Abandon`` reasons, ``Abandon``s forged for a real
consumer (wrong session) sent to every producer, and six distinct amplifying plans (most refused by the group's
routed-bytes budget; the rest pruned at the next version once their ids leave).

    note = wire_attack("forged_plan", cluster.coordinator, cluster.token)   # the refusals it got; raises if accepted
    plan = forged_plan(metadata, "attacker", "out_of_bounds")
"""

from __future__ import annotations

import socket
import struct

__all__ = ["FORGES", "wire_attack", "forged_plan"]

FORGES = ("unknown_op", "out_of_bounds", "huge")
BOUNDED = ("flood", "drip_handshake", "oversized_reason", "forged_abandon", "plan_amplify", "budget",
           "nonmember_abandon")
_HELD: list = []
"""Sockets of the last flood: held open through the next sync, closed at the next attack (or :func:`release`)."""


def release() -> None:
    while _HELD:
        try:
            _HELD.pop().close()
        except OSError:
            pass


def wire_attack(kind: str, coordinator: list, token: str, metadata_cid: str = "attacker",
                peers: list | None = None, victims: list[str] | None = None, version: int = 1) -> str:
    """One hostile peer against the coordinator (and ``peers``, the other producers' control addresses; ``victims``
    are real consumer ids, ``version`` the one about to sync); returns the typed refusal or the bound it met
    (raises if it was accepted unbounded)."""
    release()
    if kind in BOUNDED:
        return _bounded(kind, coordinator, token, metadata_cid, peers or [], victims or [], version)
    from ...engine.protocol import messages as m
    from ...engine.protocol.control import ControlClient
    from ...engine.protocol.wire import handshake_client, recv_frame
    from ...errors import AuthError, PlanError, TransportError

    if kind == "wrong_token":
        try:
            ControlClient(coordinator, token + "x", peer="coordinator")
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
            c = ControlClient(coordinator, token, peer="coordinator")
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


def _bounded(kind: str, coordinator: list, token: str, cid: str, peers: list, victims: list[str],
             version: int) -> str:
    import threading
    import time

    from ...engine.protocol import messages as m
    from ...engine.protocol.control import ControlClient
    from ...errors import PlanError, SyncError, TransportError

    addr = tuple(coordinator)
    if kind == "flood":  # idle, never authenticating; the oldest are cut, a legitimate peer still gets in
        for _ in range(200):
            try:
                _HELD.append(socket.create_connection(addr, timeout=5))
            except OSError:
                break
        return f"{len(_HELD)} idle connections held through the sync"
    if kind == "drip_handshake":  # the handshake's answer one byte every 0.5 s, in the background
        s = socket.create_connection(addr, timeout=5)
        _HELD.append(s)

        def drip() -> None:
            for b in b"a" * 48:
                try:
                    s.sendall(bytes([b]))
                except OSError:
                    return
                time.sleep(0.5)

        threading.Thread(target=drip, daemon=True).start()
        return "a handshake dripping one byte every 0.5 s"
    c = ControlClient(coordinator, token, peer="coordinator")
    try:
        if kind == "oversized_reason":
            w = c.call(m.Hello(consumer=f"{cid}-reason"), timeout_s=30)
            for v in range(1, 4):
                try:
                    c.call(m.Abandon(consumer=f"{cid}-reason", session=w.session, version=v, reason="x" * (20 << 20)),
                           timeout_s=60)
                except SyncError:
                    pass  # a version too far from the current one: refused, not kept
            lease = c.call(m.Renew(consumer=f"{cid}-reason", session=w.session), timeout_s=30)
            c.call(m.Goodbye(consumer=f"{cid}-reason", session=w.session), timeout_s=30)
            size = len(m.encode(lease))
            if size > 1 << 20:
                raise AssertionError(f"a heartbeat reply grew to {size} bytes")
            return f"3 x 20 MB reasons clipped; heartbeat reply {size} bytes"
        if kind == "forged_abandon":  # real consumers' ids, a wrong session, this version and far ones, everywhere
            held = refused = 0
            for a in [coordinator, *peers]:
                pc = ControlClient(a, token, peer=f"producer at {a}")
                try:
                    for victim in victims:
                        for v in (version, version + 1, version + 10 ** 6):
                            try:
                                pc.call(m.Abandon(consumer=victim, session="f" * 32, version=v, reason="forged"),
                                        timeout_s=30)
                                held += 1
                            except (SyncError, TransportError):
                                refused += 1
                finally:
                    pc.close()
            return f"forged Abandons: {refused} refused, {held} held without effect (wrong session)"
        if kind == "plan_amplify":
            refused, kept = 0, []
            for i in range(6):
                who = f"{cid}-amp{i}"
                w = c.call(m.Hello(consumer=who), timeout_s=30)
                try:
                    c.call(m.RegisterPlan(consumer=who, session=w.session,
                                          plan=forged_plan(w.metadata, who, "amplify", times=60 - i).to_json()),
                           timeout_s=30)
                except PlanError:
                    refused += 1
                kept.append((who, w.session))
            for who, sess in kept:
                c.call(m.Goodbye(consumer=who, session=sess), timeout_s=30)
            if refused == 0:
                raise AssertionError("six amplifying plans (60x the model each) were all accepted")
            return f"{refused} of 6 amplifying plans refused by the budgets (one group, all routed plans); the rest " \
                "pruned when they left"
        if kind == "budget":  # copies piled into one group, a whole-model gather, 100k one-element scatters
            refusals = []
            for forge, times in (("amplify", 16), ("one_group", 1), ("many_scatters", 100_000)):
                who = f"{cid}-{forge}"
                w = c.call(m.Hello(consumer=who), timeout_s=30)
                try:
                    c.call(m.RegisterPlan(consumer=who, session=w.session,
                                          plan=forged_plan(w.metadata, who, forge, times=times).to_json()),
                           timeout_s=60)
                except PlanError as e:
                    refusals.append(f"{forge}: {str(e)[:160]}")
                finally:
                    c.call(m.Goodbye(consumer=who, session=w.session), timeout_s=30)
            if len(refusals) < 2:  # the whole-model gather fits a tiny model's bound: the other two never do
                raise AssertionError(f"plans past the one-group and scatter bounds were accepted: {refusals}")
            return f"{len(refusals)} of 3 budget attacks refused: " + " | ".join(refusals)
        if kind == "nonmember_abandon":  # a bare Hello abandons this version and the next "for a lost producer"
            w = c.call(m.Hello(consumer=f"{cid}-outsider"), timeout_s=30)
            for v in (version, version + 1):
                c.call(m.Abandon(consumer=f"{cid}-outsider", session=w.session, version=v, reason="lost it",
                                 lost_producer=0), timeout_s=30)
            c.call(m.Goodbye(consumer=f"{cid}-outsider", session=w.session), timeout_s=30)
            return "a non-member abandoned 2 versions for a lost producer: not failed for the members"
    finally:
        c.close()
    raise ValueError(kind)


def forged_plan(metadata: list[dict], cid: str, forge: str, times: int = 60):
    """A sealed plan that passes the digest check but asks for a forbidden op or an out-of-bounds view — or
    (``amplify``) repeats every tensor ``times`` times in its own group, under the per-plan expansion bound: what the
    one-group bound refuses alone and the routed-bytes budget refuses together — or (``one_group``) reads every
    tensor into group ``pre``: a gather of the whole model at once — or (``many_scatters``) ``times`` one-element
    scatters: few bytes, much packing work."""
    from ...types import GroupPlan, Op, ParamMeta, Plan, Scatter, StridedView, metadata_digest

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
    elif forge in ("amplify", "one_group"):  # every trainer tensor ``times`` times over (a stride-0 outer
        from ...plan.groups import group_order, weight_group  # dimension), per group — or all in group "pre"

        by_group: dict[str, list] = {}
        for x in metas:
            k = 1
            for d in x.shape:
                k *= d
            by_group.setdefault(weight_group(x.name) if forge == "amplify" else "pre", []).append(Scatter(
                ops=(), view=StridedView(offset=0, shape=(times, k), stride=(0, 1)), shape=(times, k),
                dst_stride=(k, 1), src=x.name, src_dtype=x.dtype, dst=f"x.{x.name}", dst_byte_offset=0,
                dst_dtype=x.dtype))
        groups = tuple(GroupPlan(name=g, scatters=tuple(by_group[g]), nbytes=0,
                                 sources=tuple(sc.src for sc in by_group[g])) for g in group_order(by_group))
        return Plan(consumer=cid, meta_digest=metadata_digest(metas), groups=groups, unneeded=()).sealed()
    elif forge == "many_scatters":  # ``times`` one-element scatters of the first tensor: work, not bytes
        many = tuple(Scatter(ops=(), view=StridedView(offset=i % n, shape=(1,), stride=(1,)), shape=(1,),
                             dst_stride=(1,), src=src.name, src_dtype=src.dtype, dst="x", dst_byte_offset=i * 4,
                             dst_dtype=src.dtype) for i in range(times))
        g = GroupPlan(name="pre", scatters=many, nbytes=0, sources=(src.name,))
        return Plan(consumer=cid, meta_digest=metadata_digest(metas), groups=(g,), unneeded=()).sealed()
    else:  # huge: an in-bounds stride-0 view of 2^40 elements (terabytes of ring if it were believed)
        s = Scatter(ops=(), view=StridedView(offset=0, shape=(1 << 40,), stride=(0,)), shape=(1 << 40,),
                    dst_stride=(1,), **common)
    g = GroupPlan(name="pre", scatters=(s,), nbytes=0, sources=(src.name,))
    return Plan(consumer=cid, meta_digest=metadata_digest(metas), groups=(g,), unneeded=()).sealed()
