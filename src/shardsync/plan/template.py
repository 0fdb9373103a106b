"""Template recording: the plan of a model whose decoder layers repeat, recording only a few of them.

Decoder layers whose checkpoint tensors *and* engine parameters have identical names (up to the layer index),
shapes and dtypes form a class; only the first and the last layer of each class (plus everything outside the
layers) go through the real recorder (:func:`shardsync.plan.record.record_plan`), the other layers' groups are the
first one's with the layer index moved. The last layer is the check: its recorded group must equal the moved copy
of the first, else :func:`record_templated` returns None (record that consumer in full). The plans equal the full
ones digest for digest (``tests/programs/test_sim.py``), in a fraction of the time::

    index = LayerIndex(metas)                        # once per metadata, shared by every consumer
    plan = record_templated(model.load_weights, dict(model.named_parameters()), metas, consumer="tp0", rank=0,
                            index=index) or record_plan(...)

Pure planning: no processes; the model's loaders run on recording tensors (a meta-device model is enough).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable, Mapping, Sequence

import msgspec
import torch

from ..types import GroupPlan, ParamMeta, Plan, metadata_digest
from .groups import group_order, weight_group
from .record import record_plan

__all__ = ["LayerIndex", "record_templated", "layer_of"]

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer index in a name (``model.layers.7.mlp...`` -> 7), None outside the layers."""
    m = _LAYER.search(name)
    return int(m.group(2)) if m else None


def _move(s: str, a: int, b: int) -> str:
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{b}." if int(m.group(2)) == a else m.group(0), s, count=1)


def _moved_group(g: GroupPlan, a: int, b: int, name: str) -> GroupPlan:
    rep = msgspec.structs.replace
    return rep(g, name=name, sources=tuple(_move(s, a, b) for s in g.sources),
               scatters=tuple(rep(s, src=_move(s.src, a, b), dst=_move(s.dst, a, b)) for s in g.scatters),
               fills=tuple(rep(f, src=_move(f.src, a, b), dst=_move(f.dst, a, b)) for f in g.fills))


class LayerIndex:
    """Per-metadata facts the template mode needs, computed once for all consumers."""

    def __init__(self, metas: Sequence[ParamMeta]):
        self.layer_of = [layer_of(m.name) for m in metas]
        self.sig: dict[int, list] = {}
        self.group: dict[int, str] = {}
        for m, i in zip(metas, self.layer_of):
            if i is not None:
                self.sig.setdefault(i, []).append((_move(m.name, i, -1), m.dtype, m.shape))
                self.group.setdefault(i, weight_group(m.name))
        self.digest = metadata_digest(metas)


def record_templated(load_weights: Callable, params: Mapping[str, torch.Tensor], metas: Sequence[ParamMeta], *,
                     consumer: str, rank: int, index: LayerIndex | None = None) -> Plan | None:
    """The plan :func:`record_plan` would record for this consumer, recording one layer per class of identical
    layers (and the last one as a check); None if the check fails (record it in full then)."""
    ix = index or LayerIndex(metas)
    psig: dict[int, list] = defaultdict(list)
    for n, p in params.items():
        i = layer_of(n)
        if i in ix.sig:
            psig[i].append((_move(n, i, -1), p.dtype, tuple(p.shape), p.stride()))
    classes: dict[tuple, list[int]] = {}
    for i in sorted(ix.sig):
        classes.setdefault((tuple(ix.sig[i]), tuple(psig[i])), []).append(i)
    recorded = {c[0] for c in classes.values()} | {c[-1] for c in classes.values()}
    subset = [m for m, i in zip(metas, ix.layer_of) if i is None or i in recorded]
    sub = record_plan(metadata=subset, load_weights=load_weights, params=dict(params), consumer=consumer, rank=rank)
    groups = {g.name: g for g in sub.groups}
    dests = {d.name: d for d in sub.dests}
    for layers in classes.values():
        first, last = layers[0], layers[-1]
        g0 = groups.get(ix.group[first])
        if (g0 is None) != (ix.group[last] not in groups):
            return None
        if g0 is None:
            continue
        if last != first and _moved_group(g0, first, last, ix.group[last]) != groups[ix.group[last]]:
            return None  # the loader treats these layers differently: no template
        first_dests = [d for n, d in dests.items() if layer_of(n) == first]
        for i in layers[1:-1]:
            groups[ix.group[i]] = _moved_group(g0, first, i, ix.group[i])
            for d in first_dests:
                moved = msgspec.structs.replace(d, name=_move(d.name, first, i))
                dests[moved.name] = moved
    used = {s for g in groups.values() for s in g.sources}
    return Plan(consumer=sub.consumer, meta_digest=ix.digest, groups=tuple(groups[g] for g in group_order(groups)),
                unneeded=tuple(m.name for m in metas if m.name not in used),
                dests=tuple(sorted(dests.values(), key=lambda d: d.name))).sealed()
