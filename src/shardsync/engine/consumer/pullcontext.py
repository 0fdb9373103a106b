"""What a consumer's pullers, chunk sinks and applier need from it: :class:`PullContext`, built once by
``Consumer.init`` (when its session, plan and connections exist) and handed down; none of them reads the
``Consumer`` itself. Plus :func:`producer_lost`, the typed error every read path raises for a producer it lost::

    ctx = PullContext(id="r0/tp1", transport=t, timeout_s=120, lease_s=10, chunk_key=key, verify_checksums=False,
                      mac_required=lambda: False, lane=Lane(None), plan=plan, layouts=layouts,
                      clients=clients, rclients=rclients, peers=peers, peer_view=heartbeat.view)
    raise ctx.lost(p, version, group, e)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..lanes import Lane
from ...errors import ProducerLost
from ...plan.pack import GroupLayout
from ...types import Plan

__all__ = ["PullContext", "producer_lost"]


def producer_lost(consumer_id: str, p: int, version: int, group: str, e: Exception) -> ProducerLost:
    """The typed error for producer ``p`` lost (during ``version``, or when connecting); names it in ``.producer``."""
    where = f"during version {version} (group {group!r})" if group else "when connecting"
    err = ProducerLost(f"consumer {consumer_id}: producer {p} lost {where}: {e}")
    err.producer = p  # type: ignore[attr-defined]
    return err


@dataclass(frozen=True)
class PullContext:
    """One consumer session's settings and connections, as its pullers, sinks and applier see them."""

    id: str
    """The consumer id (every message, thread name and error says it)."""
    transport: Any
    """The data plane (``transport.read``, ``transport.name``)."""
    timeout_s: float
    lease_s: float
    chunk_key: bytes
    """The group's chunk key (``security/chunkmac.py``)."""
    verify_checksums: bool
    """Refuse chunks without a checksum."""
    mac_required: Callable[[], bool]
    """Whether chunks must carry a keyed tag now (``require_mac``, or the coordinator's connection is MACed)."""
    lane: Lane
    """Where ``apply`` runs."""
    plan: Plan
    layouts: dict[str, GroupLayout]
    """Group -> this consumer's chunk layout."""
    clients: dict[int, Any]
    """Producer -> its control connection (``WaitReady``); kept current by the consumer's connect step."""
    rclients: dict[int, Any]
    """Producer -> its second connection, for ``Released``."""
    peers: dict[int, tuple[int, Any]]
    """Producer -> (incarnation, descriptor) connected."""
    peer_view: Callable[[], dict[str, Any]]
    """The heartbeat's view of the group: ``dead_producers`` and ``failed`` versions."""

    def lost(self, p: int, version: int, group: str, e: Exception) -> ProducerLost:
        return producer_lost(self.id, p, version, group, e)
