"""Which trainer session owns an engine, when another may take it over, and where the new one's versions resume.

A trainer session (``ShardsyncTrainerEngine.trainer_init``: a session id it generates, its coordinator's address)
owns every worker it initialised. Worker side (``ShardsyncEngine.init_transfer_engine``), an init from another
session is

* **refused at once** (:class:`EngineOwnedError`, naming the owner's session and coordinator) while the owner's
  lease is live: the worker's consumer still renews it with the owner's coordinator, or a ``Renew`` sent there
  now is answered;
* **accepted** once the owner is gone: its coordinator does not answer and the worker's lease there lapsed
  (``Heartbeat.view`` raises: at most about two leases after the owner died; the init waits that long), or the
  address now serves another group (a trainer restarted on the same port: the old session is unknown there).
  The old consumer is closed (bounded, no goodbye), an update window the dead owner left open is closed (torn if
  it had applied groups), and a new consumer joins the new session's group.

Updates carry their session (``ShardsyncUpdateInfo.session``): one from another session than the owner's — a
displaced trainer that woke up, a replayed request — is refused before anything is applied. Versions resume: the
new session's first version must be newer than its ``start_version`` (which the trainer names: a checkpoint's
step, or the engines' own weight version, :func:`engine_versions`), not than what the previous session reached.

    owner = Owner.of(init_info)                         # worker: (coordinator, session) of an init
    if current is not None and current.owner != owner:
        wait_owner_gone(current_consumer, current.owner, rank=0)     # raises EngineOwnedError while it is live
    start = resume_version(engine_versions(client))                  # trainer: after the newest held version
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from ...errors import AuthError, ShardsyncError, SyncError

__all__ = ["EngineOwnedError", "StaleSessionError", "Owner", "owner_gone", "wait_owner_gone", "engine_versions",
           "resume_version", "OWNED_MARK", "STALE_MARK"]

OWNED_MARK = "is owned by trainer session"
"""Text every ownership refusal carries (a refusal crosses vLLM's RPCs and HTTP as text; the trainer re-types it)."""
STALE_MARK = "is not the session that owns this engine"


class EngineOwnedError(SyncError):
    """Another trainer session owns this engine and its lease is live: a second trainer is refused."""


class StaleSessionError(SyncError):
    """An update of a session that does not own the engine (a displaced trainer, a replayed request)."""


@dataclass(frozen=True)
class Owner:
    """One trainer session: its coordinator (producer 0's control address) and the session id it generated."""

    coordinator: tuple[str, int]
    """``(host, port)`` of the session's coordinator."""
    session: str = ""
    """The id the trainer generated at ``trainer_init`` (empty: shardsync's own API, which names none; the
    coordinator's address alone then tells sessions apart)."""

    @classmethod
    def of(cls, init_info: Any) -> "Owner":
        from ...engine.protocol.wire import parse_address

        host, port = parse_address(init_info.coordinator)
        return cls(coordinator=(str(host), int(port)), session=str(getattr(init_info, "session", "") or ""))

    def __str__(self) -> str:
        who = f"trainer session {self.session!r}" if self.session else "a trainer session"
        return f"{who} (coordinator {self.coordinator[0]}:{self.coordinator[1]})"


def _probe(consumer: Any, timeout_s: float) -> str:
    """Ask the owner's coordinator to renew this worker's lease now: ``"live"`` (answered, or it says we were dropped:
    it is there and the consumer rejoins it), ``"other"`` (a server that does not know the session: another group
    took the address) or ``"silent"`` (unreachable, or no answer within ``timeout_s``)."""
    from ...engine.protocol import messages as m
    from ...engine.protocol.control import ControlClient
    from ...errors import ConsumerDropped

    client = None
    try:
        client = ControlClient(consumer.coordinator, consumer.token, peer="the owner's coordinator",
                               connect_timeout_s=timeout_s, require_mac=consumer.require_mac)
        client.call(m.Renew(consumer=consumer.id, session=consumer.session), timeout_s=timeout_s)
        return "live"
    except ConsumerDropped:
        return "live"
    except AuthError:
        return "other"
    except (ShardsyncError, OSError):
        return "silent"
    finally:
        if client is not None:
            client.close()


def _lapsed(consumer: Any) -> bool:
    """The consumer's lease with its coordinator lapsed: no renewal answered for a lease (``Heartbeat.view``)."""
    hb = getattr(consumer, "heartbeat", None)
    if hb is None:
        return True
    try:
        hb.view()
    except ShardsyncError:
        return True
    return False


def owner_gone(consumer: Any) -> bool | None:
    """True: the owner is gone (its lease lapsed, or its address serves another group); False: it is live (its
    coordinator answered); None: it does not answer yet, but the lease has not lapsed."""
    if consumer is None or _lapsed(consumer):
        return True
    state = _probe(consumer, timeout_s=max(0.5, min(2.0, float(getattr(consumer, "lease_s", 2.0)) / 2)))
    if state == "live":
        return False
    if state == "other":
        return True
    return True if _lapsed(consumer) else None


def wait_owner_gone(consumer: Any, owner: Owner, new: Owner, *, rank: int) -> None:
    """Return once ``owner`` (the session ``consumer`` belongs to) is gone; raise :class:`EngineOwnedError` at once
    while it is live. Bounded: the lease lapses at most about two leases after the owner stopped answering."""
    lease = float(getattr(consumer, "lease_s", 10.0) or 10.0)
    deadline = time.monotonic() + 2 * lease + 2
    while True:
        gone = owner_gone(consumer)
        if gone:
            return
        if gone is False or time.monotonic() > deadline:
            raise EngineOwnedError(
                f"rank {rank}: this engine {OWNED_MARK} {owner.session!r} at coordinator "
                f"{owner.coordinator[0]}:{owner.coordinator[1]}, whose lease is live"
                + ("" if gone is False else " (it stopped answering but its lease has not lapsed)")
                + f": {new} is refused. Stop that trainer (a clean exit releases the engine) or let its lease "
                  f"lapse ({lease:g} s) before another takes over")
        time.sleep(min(0.25, lease / 8))


def retype(err: BaseException) -> BaseException:
    """An ownership refusal that reached the trainer as text (vLLM's RPC, HTTP) as its typed error; else ``err``."""
    text = str(err)
    if OWNED_MARK in text:
        return EngineOwnedError(text)
    if STALE_MARK in text:
        return StaleSessionError(text)
    return err


# ------------------------------------------------------------------------------------------- trainer side
def engine_versions(client: Any, *, timeout_s: float = 10.0) -> list[str]:
    """The weight versions the engines behind ``client`` report (vLLM's labels, which the torn guard keeps true:
    ``"3"``, ``"torn:3+4"``): an in-process ``LLM`` (``get_weight_version``), vLLM's HTTP client (the server's
    ``/weight_info``), vLLM's Ray client (each actor), any client with ``get_weight_version()``. Empty where the
    client cannot say (vLLM 0.26 labels no versions)."""
    own = getattr(client, "get_weight_version", None)
    llm = getattr(client, "llm", None)
    if not callable(own) and llm is not None:
        own = getattr(llm, "get_weight_version", None)
    try:
        if callable(own):
            v = own()
            return [] if v is None else [str(v)]
        base = getattr(client, "base_url", None)
        if isinstance(base, str):
            import requests

            r = requests.get(f"{base.rstrip('/')}/weight_info", timeout=timeout_s)
            return [str(r.json()["weight_version"])] if r.ok else []
        handles = getattr(client, "handles", None)
        ray = sys.modules.get("ray")
        if isinstance(handles, list) and handles and ray is not None:
            return [str(v) for v in ray.get([h.get_weight_version.remote() for h in handles], timeout=timeout_s)]
    except Exception:  # an engine that cannot say: the trainer starts after 0 (the engines accept a new session)
        return []
    return []


def resume_version(labels: list[str]) -> int:
    """The newest version any engine's label names (``"torn:3+4"`` -> 4), 0 if none: a new session's first version
    is the next one, so it is newer than every version any weight group holds."""
    found = []
    for label in labels:
        hit = re.fullmatch(r"(?:torn:)?(\d+(?:\+\d+)*)", str(label or "").strip())
        if hit:  # a label the driver chose (not a version) says nothing
            found += [int(x) for x in hit.group(1).split("+")]
    return max(found, default=0)
