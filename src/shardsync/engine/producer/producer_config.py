"""A trainer rank's producer configuration: the group's settings (``config.GroupSettings``) and this rank's own.

    cfg = ProducerConfig(rank=0, n_producers=2, n_consumers=4, token=token, transport="nixl", device="cuda:0")

:func:`producer_options` checks what a surface passes through by name (vLLM's ``producer_options``, verl's and
Ray's keyword arguments): every field here is reachable from every integration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ...config import GROUP_FIELDS, GroupSettings
from ...plan.pack import DEFAULT_CHUNK_BYTES

__all__ = ["ProducerConfig", "producer_options", "PRODUCER_FIELDS"]


@dataclass
class ProducerConfig(GroupSettings):
    """One trainer rank's producer: the group's settings (``GroupSettings``: token, transport, timeouts, lease,
    checksums, mac, delta, frame limit, ...) and this rank's own."""

    rank: int
    n_producers: int
    n_consumers: int
    host: str = "127.0.0.1"
    """Interface the control server (and the tcp transport) bind to."""
    advertise_host: str | None = None
    """Address peers are told to use (required in practice when ``host`` is 0.0.0.0)."""
    port: int = 0
    """Control port; rank 0's is the coordinator address consumers are given."""
    coordinator: list[Any] | str | None = None
    """Address of rank 0's control server (ranks > 0): ``"host:port"`` or ``[host, port]``."""
    lookahead: int = 1
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    straggler_s: float | None = None
    """A member that has not released a group this long after it was announced, nor any other group of this rank in
    that time, is dropped from that version (``producer.py`` rule 2; it receives the next one). None: three leases, at least
    10 s, at most half of ``timeout_s``. It bounds how long after the trainer's ``sync`` an engine starts pulling and
    one group's pull (and, for direct reads, apply): raise it for engines that are slow to start an update."""
    min_consumers: int | None = None
    """Init quorum (default: all ``n_consumers``); with fewer, init proceeds after ``join_grace_s``."""
    join_grace_s: float = 30.0
    max_routed_bytes: int | None = None
    """Rank 0: what all consumers' routed plans together may carry a sync (None: 64 copies of the model). A plan
    past it is refused at its registration, naming the consumer: no buggy or hostile engine grows the rings (trainer
    memory, GPU memory with ``device``) without bound. Plans of consumers that left are pruned at the next version."""
    max_group_bytes: int | None = None
    """Rank 0: what one weight group may carry over all routed plans together, and what the full tensors it reads
    may weigh (None: four times the model's largest weight group). A ring slot holds one group of every plan and a
    gather one group's sources, so this bounds the ring (``lookahead + 1`` slots) and the gather peak whatever the
    plans; a plan past it is refused at its registration, naming the consumer and the group."""
    device: str | None = None
    """Where the ring lives and packing runs (``"cuda:0"``; None: CPU memory). With a GPU the ring is allocated
    there once (``stats["ring_bytes"]``: subtract it from what the trainer may use), replay + pack run on a side
    stream after the stream that wrote the weights, and a group is announced once its pack has run; the transport
    must move GPU memory (``cuda_ipc``, ``nccl``, ``nixl``)."""
    node: str = ""
    """Where this rank runs (a Ray node id, a hostname; "" = unknown): consumers that say they run on the same node
    read from it first (``plan/route.py`` rule 5)."""
    gather_budget_bytes: int | None = None
    """Most full-tensor bytes this rank may hold at once while gathering (None: unbounded). Refused at init when
    the source's largest gather group (plus what must be carried across groups) does not fit."""
    source_reads: bool | None = None
    """Serve groups where the trainer's tensors lie to consumers that map this rank's memory (``source_share.py``: no
    pack pass, no ring slot). None: on for a GPU ring; needs no checksums, ``mac`` or delta."""
    delta_budget_bytes: int | None = None
    """Most bytes the delta history may keep (the served chunks once, the rest for its undo journal, up to as much
    again); None: the chunks once, no journal — the served bytes of the model's share, and a failed version's
    encoded chunks go dense once next version (a journal restores their bases instead). Refused at init
    (``DeltaBudgetError``) when the chunks alone do not fit."""
    delta_host_history: bool = False
    """Keep the delta history in pinned host memory rather than on a GPU ring's device: no device bytes for the
    bases; each encode copies its chunk's base to the device and the changes back (about the model's bytes over
    PCIe a sync)."""


PRODUCER_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ProducerConfig) if f.name not in GROUP_FIELDS)
"""The fields of one rank's own (beside the group's settings)."""


def producer_options(opts: Mapping[str, Any], *, where: str, reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """``opts`` as ``ProducerConfig`` keyword arguments: each name must be a producer field that the surface does not
    set itself (``reserved``; the group settings have their own place): else a ``TypeError`` naming it."""
    bad = sorted(k for k in opts if k not in PRODUCER_FIELDS or k in reserved)
    if bad:
        ok = [f for f in PRODUCER_FIELDS if f not in reserved]
        raise TypeError(f"{where}: {bad[:8]} are not ProducerConfig options it can set (group settings are fields "
                        f"of their own); it takes {ok}")
    return dict(opts)
