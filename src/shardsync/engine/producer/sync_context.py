"""What one sync of one producer is given (``producer_sync.ProducerSync``): the producer's collaborators, named.

The :class:`~.producer.Producer` builds a :class:`SyncContext` for each sync (after its begin: the epoch's layout may
have changed there) and hands it down; the sync reads these fields only, never the producer::

    ctx = SyncContext(cfg=cfg, table=table, layout=layout, lane=lane, ...)
    stats = ProducerSync(ctx, version, state, source).run()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..lanes import Lane
from ..protocol import messages as m
from ..source_reads.source_share import SourceShare
from .same_batches import SameBatches
from .units import RingLayout
from .versions import VersionState, VersionTable
from ...types import ParamMeta

__all__ = ["SyncContext"]


@dataclass(frozen=True)
class SyncContext:
    cfg: Any
    """The producer's ``ProducerConfig`` (reads ``rank``, ``lookahead``, ``timeout_s``, ``lease_s``)."""
    table: VersionTable
    """The versions this rank serves: announcing, waiting (and pruning), its condition ``cv``."""
    layout: RingLayout
    """This epoch's units, schedule, ring and delta sender."""
    lane: Lane
    """Where packing runs (a side stream on a GPU)."""
    same_batches: SameBatches
    """Per gather batch, the last sync's checks (kept between syncs)."""
    shares: SourceShare | None
    """Source reads, when on."""
    checksums: bool
    """Send an xxh3 checksum with every chunk."""
    chunk_key: bytes | None
    """With ``mac``: the key chunks are tagged with."""
    expect: dict[str, tuple[Any, Any]]
    """Name -> (shape, dtype) the metadata says."""
    metas: list[ParamMeta]
    stats: dict[str, Any]
    """The producer's stats, updated in place with the sync's."""
    source_stats: Callable[[], dict[str, Any]]
    """The trainer's source's own counters, at the end of the sync."""
    fail: Callable[[int, VersionState, BaseException], None]
    """Fail the version for all (the coordinator and every consumer waiting on it are told)."""
    drain: Callable[[], None]
    """Let the replies to releases already handled go out."""
    poll_outcome: Callable[[int], m.Outcome]
    """One look (bounded by about a lease) at the version's outcome, from the coordinator."""
