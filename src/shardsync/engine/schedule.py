"""The sync schedule: what is gathered when, how many groups are resident, when a slot is freed, when a
consumer pulls and applies. These rules are stated here once; ``producer.py``, ``producer_sync.py``,
``consumer.py``, ``puller.py``, ``applier.py`` and ``recvslots.py`` follow them.

This module computes the producer's half, the lockstep schedule (:func:`lockstep`), once per assignment from
the source's gather groups and the chunks routed to this rank. Pure: no processes, no sockets.

Producer (one trainer rank), per sync:

1. Lockstep. Every rank iterates EVERY batch of its source's ``iter_groups()`` (the groups holding a name it
   holds), in the source's order, whether or not anything in it is routed here: materialising a group is a
   collective among the ranks holding part of it. A rank never gathers a group it does not hold (never
   across PP, never another EP rank's experts), and never gathers a group twice in one sync. Also when the
   sync fails on this rank (the engines are gone, the version failed, a slot wait timed out): the rank still
   iterates the batches it has not (nothing packed), then raises — so no other rank waits in a collective for
   it; the others fail the version through the coordinator.
2. Keep only what is routed. From each batch the rank keeps the tensors its routed chunks read
   (``keep[b]``); the rest of the batch is dropped as soon as the batch has been looked at.
3. One order for everyone. Plan groups are packed in transfer order (``plan.groups.group_order``: pre,
   layers, post), the order every consumer receives in, so no consumer ever waits for a producer that is
   busy with a group it wants later (a receive slot is never held across an order inversion). A group is
   packed right after the batch that completes it and every group before it (``pack_after[b]``); the
   tensors it read are dropped once no later group needs them (``drop_after[b]``; a tied embedding lives
   until ``post``). When the source's order is the transfer order (HF checkpoints) nothing but such shared
   tensors is carried across batches. Only groups this rank routes to someone are packed.
4. Resident groups. The ring has ``lookahead + 1`` slots of the largest group's size, allocated once. A
   batch that completes a routed group is gathered only when a ring slot is free, so at most
   ``lookahead + 1`` groups are packed-and-unreleased (``stats["max_resident"]``). Each distinct plan's
   chunks are packed once; every consumer sharing that plan (the same rank of different replicas) pulls the
   same bytes.
5. Budget. ``peak_bytes`` is the most full-tensor bytes resident at once on this rank: one batch as
   materialised by the source plus what is carried across batches. A configured gather budget
   (``gather_budget_bytes``) below it is refused at init (the rank could not follow rule 1 within it); the
   producer measures the real peak each sync (``stats["peak_gathered_bytes"]``).
6. Overlap. Gathering and packing group g+1 overlaps the consumers' pulls of group g: a group is announced
   (``Ready``) once its pack has run (on a GPU a publisher thread waits for the pack's event,
   ``publish.py``) and the gather thread moves on to g+1. Producers of different PP stages serve at once.
7. A ring slot is freed when every member routed to its group has sent ``Released`` or has been dropped (it
   abandoned the version, said goodbye, its lease expired, or it held the group ``straggler_s`` past its
   announcement): nothing waits for a dead or a straggling consumer.

Consumer (one inference engine), per sync:

8. Pulls. One puller per producer, all at once (every PP stage, every EP rank concurrently). Each asks its
   producer for "the next group you have for me" (rule 3: they arrive in transfer order) and, while it
   reads that group, already for the one after it (``WaitReady.after``); it reads the group's chunks into
   the group's receive slot and sends ``Released`` right after the bytes have landed (on a connection of
   its own, in the background: a release never queues behind a ``WaitReady`` the producer holds), so the
   producer's ring slot is freed before the group is applied. (``parallel_producers=False``: one puller,
   group by group, each group's producers one after the other — the reference the benchmark compares.)
9. Receive slots. ``recv_slots`` buffers of the largest group's size, allocated once: the consumer's
   receive memory (``recv_budget_bytes`` lowers the count, never below 2). A group gets a slot the first
   time any of its producers' bytes arrive; its other producers write into the same slot. A group may
   take the LAST free slot only if it is the head (the first group in transfer order that has no slot
   yet); any other group needs two free slots. Each puller's groups are an increasing subsequence of one
   order (rule 3), so the smallest incomplete group can always get a slot, its pullers are never blocked
   behind a later group, and every sync finishes: pulling from every producer at once cannot deadlock.
10. Apply. A group whose every producer's part has landed goes to the one apply thread (unpack → scatter
    into the engine's buffers → the engine's per-layer processing), which overlaps the pulls; groups may
    complete out of transfer order (PP stages in parallel). Its receive slot is freed (read directly: the group
    released) once it has been applied (on a GPU: once the apply's side-stream work has run, an event, not a
    device synchronize). Up to ``applier.DEPTH`` applies are queued on the GPU before the oldest is waited for,
    and the oldest is waited for whenever no new group has landed: slots never wait on a group still queued.

    ls = lockstep(source.groups(), needs={"model.layers.0": {...names}}, held=None, nbytes=nbytes)
    ls.order     # plan groups in packing order
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from ..errors import MetadataMismatch
from ..plan.groups import group_order

__all__ = ["Lockstep", "lockstep"]


@dataclass(frozen=True)
class Lockstep:
    batches: list[list[str]]
    """The source's gather groups, in its iteration order (every one is iterated, rule 1)."""
    keep: list[frozenset[str]]
    """Per batch: the names kept (read by this rank's routed chunks)."""
    pack_after: list[list[str]]
    """Per batch: the plan groups complete after it, packed in this order."""
    drop_after: list[list[str]]
    """Per batch: kept names no later plan group reads."""
    order: list[str]
    """Every plan group routed here, in packing order."""
    peak_bytes: int
    """Most full-tensor bytes resident at once (rule 5)."""
    batch_bytes: list[int]
    """Bytes each batch materialises on this rank (names held here)."""


def lockstep(batches: Sequence[Sequence[str]], *, needs: Mapping[str, Collection[str]],
             held: Collection[str] | None, nbytes: Mapping[str, int], rank: int = 0) -> Lockstep:
    """The schedule for one rank. ``needs``: plan group -> checkpoint names its routed chunks read."""
    where: dict[str, int] = {}
    for b, names in enumerate(batches):
        for n in names:
            if n in where:
                raise MetadataMismatch(f"producer {rank}: the source yields {n!r} in two gather groups")
            where[n] = b
    done_at: dict[str, int] = {}
    for g, names in needs.items():
        missing = [n for n in names if n not in where]
        if missing:
            raise MetadataMismatch(f"producer {rank}: group {g!r} is routed here and needs {sorted(missing)[:3]}, "
                                   "which this rank's source never yields (held_names() and groups() disagree)")
        done_at[g] = max((where[n] for n in names), default=0)
    order = group_order(needs)
    packed_at: dict[str, int] = {}  # a group is packed once it and every group before it are complete
    for g in order:
        packed_at[g] = max(done_at[g], packed_at[order[len(packed_at) - 1]] if packed_at else 0)
    last_use: dict[str, int] = {}
    for g in order:
        for n in needs[g]:
            last_use[n] = max(last_use.get(n, -1), packed_at[g])
    heldset = None if held is None else set(held)
    keep = [frozenset(n for n in names if n in last_use) for names in batches]
    pack_after: list[list[str]] = [[] for _ in batches]
    drop_after: list[list[str]] = [[] for _ in batches]
    for g in order:
        pack_after[packed_at[g]].append(g)
    for n, b in sorted(last_use.items()):
        drop_after[b].append(n)
    batch_bytes = [sum(nbytes[n] for n in names if heldset is None or n in heldset) for names in batches]
    peak = carried = 0
    for b, names in enumerate(batches):
        peak = max(peak, batch_bytes[b] + carried)
        carried += sum(nbytes[n] for n in keep[b])
        carried -= sum(nbytes[n] for n in drop_after[b])
    return Lockstep(batches=[list(x) for x in batches], keep=keep, pack_after=pack_after, drop_after=drop_after,
                    order=order, peak_bytes=peak, batch_bytes=batch_bytes)
