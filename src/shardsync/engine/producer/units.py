"""What one producer packs and serves: its units (one chunk of one plan's group each) and its lockstep schedule.

Built from the coordinator's assignments at init, and again when a rejoiner's new plan bumps the epoch.
Every plan's units of one group share that group's ring slot, at fixed offsets; the slot size is the
largest group's. Packers are built once here (their views are then kept between syncs). A
:class:`RingLayout` is what one epoch serves from: its units and schedule, the ring they are packed into and the
delta sender beside it::

    units, schedule, slot_bytes = build_units(assignments, metas, source, rank=0, max_chunk_bytes=64 << 20)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..protocol import messages as m
from ..schedule import Lockstep, lockstep
from ...delta.sender import DeltaSender
from ...errors import TransportError
from ...plan.pack import Chunk, GroupPacker, _align
from ...plan.route import chunk_layouts, digest_of, holders_from_ownership
from ...types import ParamMeta, Plan

__all__ = ["Unit", "RingLayout", "build_units", "RELEASED_RING_BYTES"]

RELEASED_RING_BYTES = 64
"""What stands in for a released ring (a transport registers a buffer; no chunk is ever read from it)."""


@dataclass
class Unit:
    """One chunk of one plan's group that this producer packs and serves (fixed per assignment epoch)."""

    digest: str
    chunk: Chunk
    slot_offset: int  # offset inside a ring slot
    packer: GroupPacker
    sources: frozenset[str]  # checkpoint names the chunk's slices come from


@dataclass
class RingLayout:
    """What this rank serves from in one assignment epoch (rebuilt when the epoch changes; the ring is kept unless a
    slot must grow)."""

    units: dict[str, list[Unit]]
    """Group -> this rank's units of it."""
    schedule: Lockstep
    """The lockstep schedule of the source (``engine/schedule.py``)."""
    unit_sources: dict[str, list[str]]
    """Group -> the checkpoint names its units read (sorted)."""
    ring: torch.Tensor
    """``n_slots`` slots of ``slot_bytes``, registered with the transport."""
    n_slots: int
    slot_bytes: int
    dense_slot: int
    """Bytes of a slot's dense part (with delta sync the rest of the slot is its delta area)."""
    delta: DeltaSender | None
    """Delta sync's sender (``ProducerConfig.delta``), or None."""
    by_source: set[str] = field(default_factory=set)
    """Groups served by their source tensors last sync (no ring slot awaited for them); each sync replaces it."""
    released: bool = False
    """The ring is let go (``ring`` is a stand-in of ``RELEASED_RING_BYTES``): every member maps the trainer's
    tensors and the last version served every group from them. A group that cannot be served from them this
    version is served from a copy of its tensors (at most ``n_slots`` at once) instead of a ring slot."""

    @property
    def order(self) -> list[str]:
        """Every group routed here, in packing order."""
        return self.schedule.order


def build_units(asg: Any, metas: list[ParamMeta], source: Any, *, rank: int,
                max_chunk_bytes: int) -> tuple[dict[str, list[Unit]], Lockstep, int]:
    """(group -> this rank's units, the lockstep schedule of its source, ring slot bytes)."""
    if not isinstance(asg, m.Assignments):
        raise TransportError(f"producer {rank}: coordinator answered {type(asg).__name__}, expected Assignments")
    plans = {p.digest: p for p in (Plan.from_json(b) for b in asg.plans)}
    holders = holders_from_ownership(asg.held, [x.name for x in metas])
    units: dict[str, list[Unit]] = defaultdict(list)
    slot_end: dict[str, int] = defaultdict(int)  # units of every plan share their group's slot
    for d, routes in sorted(asg.routes.items()):  # d: a route key (a plan digest, per node where node-aware)
        plan = plans[digest_of(d)]
        layouts = chunk_layouts(plan, holders, max_chunk_bytes=max_chunk_bytes)
        for g, per_chunk in routes.items():
            for ci, p in enumerate(per_chunk):
                if p == rank:
                    lay, gp = layouts[g], plan.group(g)
                    c = lay.chunks[ci]
                    srcs = frozenset(s.src for s in gp.scatters[c.first:c.stop])
                    units[g].append(Unit(d, c, slot_end[g], GroupPacker(gp, lay), srcs))
                    slot_end[g] = _align(slot_end[g] + c.nbytes, 64)
    needs = {g: frozenset().union(*(u.sources for u in us)) for g, us in units.items()}
    schedule = lockstep(source.groups(), needs=needs, held=source.held_names(),
                        nbytes={x.name: x.nbytes for x in metas}, rank=rank)
    slot = _align(max(max((u.slot_offset + u.chunk.nbytes for us in units.values() for u in us), default=0), 1), 64)
    return dict(units), schedule, slot
