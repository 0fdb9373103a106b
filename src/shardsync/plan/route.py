"""Routing: which producer serves each chunk of each consumer's plan. Pure functions.

Rules:
1. A chunk is served by one producer that holds every source tensor of its slices (chunks are cut
   where the holder set changes: see ``chunk_layouts``).
2. Consumers with the same plan (the same TP/EP rank of different replicas) get the same routes, so a
   producer packs each chunk once and every replica pulls that one copy.
3. Load balance: units (plan, group, holder set) are assigned largest first to the holder least
   loaded *within that group* (groups move roughly in lockstep, so a group takes as long as its
   busiest producer), ties broken by the whole-sync load; bytes counted as sent (bytes × consumers
   sharing the plan).
4. A needed source with no holder fails with MetadataMismatch naming it.
5. Node-aware: routes are per route key — a plan digest, or ``digest@node`` for consumers that said where
   they run; ``prefer[key]`` (the producers on that node) wins over load among a chunk's holders, so a
   consumer reads from a producer on its own node whenever one holds the bytes.

    routes = route_plans(plans_by_digest, holders, n_consumers_by_digest)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Collection, Mapping, Sequence

from ..errors import MetadataMismatch
from .pack import DEFAULT_CHUNK_BYTES, GroupLayout, layout_group
from ..types import Plan

__all__ = ["holders_from_ownership", "chunk_layouts", "route_plans", "Routes", "route_key", "digest_of"]

Routes = dict[str, dict[str, list[int]]]
"""plan digest -> group -> producer per chunk."""


def route_key(digest: str, node: str = "") -> str:
    """What routes are keyed by: the plan digest, per node when the consumer gave one (rule 5)."""
    return f"{digest}@{node}" if node else digest


def digest_of(key: str) -> str:
    return key.split("@", 1)[0]


def holders_from_ownership(held: Sequence[Sequence[str] | None], names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``held[p]`` = names producer p holds (None = all) -> name -> producers holding it."""
    out: dict[str, list[int]] = defaultdict(list)
    for p, hs in enumerate(held):
        for n in (names if hs is None else hs):
            out[n].append(p)
    return {n: tuple(ps) for n, ps in out.items()}


def chunk_layouts(plan: Plan, holders: Mapping[str, Sequence[int]], *,
                  max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, GroupLayout]:
    """Each group's layout, chunks cut where the holder set of the sources changes."""
    for g in plan.groups:
        for s in g.scatters:
            if not holders.get(s.src):
                raise MetadataMismatch(f"consumer {plan.consumer!r} needs tensor {s.src!r} (group {g.name!r}), "
                                       "which no producer holds")
    return {g.name: layout_group(g, max_chunk_bytes=max_chunk_bytes,
                                 split_key=lambda s: tuple(sorted(holders[s.src]))) for g in plan.groups}


def route_plans(plans: Mapping[str, Plan], holders: Mapping[str, Sequence[int]], consumers_per_plan: Mapping[str, int],
                *, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                base_load: Mapping[int, int] | None = None,
                prefer: Mapping[str, Collection[int]] | None = None) -> tuple[Routes, dict[int, int]]:
    """Assign every chunk of every distinct plan (route key -> plan) to a producer. Returns (routes, bytes sent
    per producer). ``base_load``: bytes each producer already sends (routing a late joiner's plan against the
    others). ``prefer``: route key -> producers to use first when they hold a chunk (rule 5)."""
    units = []  # (bytes sent, digest, group, holder set, chunk indices)
    layouts = {d: chunk_layouts(p, holders, max_chunk_bytes=max_chunk_bytes) for d, p in plans.items()}
    routes: Routes = {d: {g: [-1] * len(lay.chunks) for g, lay in ls.items()} for d, ls in layouts.items()}
    for digest, plan in sorted(plans.items()):
        for g in plan.groups:
            by_set: dict[tuple[int, ...], list[int]] = defaultdict(list)
            nbytes: dict[tuple[int, ...], int] = defaultdict(int)
            for c in layouts[digest][g.name].chunks:
                hs = tuple(sorted(holders[g.scatters[c.first].src]))
                by_set[hs].append(c.index)
                nbytes[hs] += c.nbytes
            for hs, idx in by_set.items():
                units.append((nbytes[hs] * consumers_per_plan.get(digest, 1), digest, g.name, hs, idx))
    load: dict[int, int] = defaultdict(int, base_load or {})
    group_load: dict[tuple[str, int], int] = defaultdict(int)
    for nb, digest, gname, hs, idx in sorted(units, key=lambda u: (-u[0], u[1], u[2], u[3])):
        near = (prefer or {}).get(digest) or ()
        p = min(hs, key=lambda q: (q not in near, group_load[(gname, q)], load[q], q))
        load[p] += nb
        group_load[(gname, p)] += nb
        for i in idx:
            routes[digest][gname][i] = p
    return routes, dict(load)
