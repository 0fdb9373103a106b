"""Hostile peers for the chaos runs and the wire tests: a peer with a wrong token, one announcing a 4 GiB control
frame, and one that registers forged plans (a sealed plan whose digest checks out but which asks for a
non-allow-listed op, an out-of-bounds view or terabytes of ring) — each must be refused with a typed error.

    note = wire_attack("forged_plan", cluster.coordinator, cluster.token)   # the refusals it got; raises if accepted
    plan = forged_plan(metadata, "attacker", "out_of_bounds")
"""

from __future__ import annotations

import socket
import struct

__all__ = ["FORGES", "wire_attack", "forged_plan"]

FORGES = ("unknown_op", "out_of_bounds", "huge")


def wire_attack(kind: str, coordinator: list, token: str, metadata_cid: str = "attacker") -> str:
    """One hostile peer against the coordinator; returns the typed refusal it got (raises if it was not refused)."""
    from ...engine import messages as m
    from ...engine.control import ControlClient
    from ...engine.wire import handshake_client, recv_frame
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


def forged_plan(metadata: list[dict], cid: str, forge: str, times: int = 60):
    """A sealed plan that passes the digest check but asks for a forbidden op or an out-of-bounds view — or
    (``amplify``, allowed on its own) repeats the first tensor ``times`` times, under the per-plan expansion bound:
    many such plans together are what the group's routed-bytes budget refuses."""
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
    elif forge == "amplify":  # the whole tensor, ``times`` times over (a stride-0 outer dimension)
        s = Scatter(ops=(), view=StridedView(offset=0, shape=(times, n), stride=(0, 1)), shape=(times, n),
                    dst_stride=(n, 1), **common)
    else:  # huge: an in-bounds stride-0 view of 2^40 elements (terabytes of ring if it were believed)
        s = Scatter(ops=(), view=StridedView(offset=0, shape=(1 << 40,), stride=(0,)), shape=(1 << 40,),
                    dst_stride=(1,), **common)
    g = GroupPlan(name="pre", scatters=(s,), nbytes=0, sources=(src.name,))
    return Plan(consumer=cid, meta_digest=metadata_digest(metas), groups=(g,), unneeded=()).sealed()
