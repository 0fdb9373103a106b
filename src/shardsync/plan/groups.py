"""Split checkpoint names into weight groups: ``pre``, one group per decoder layer, ``post``.

A weight group is the unit of gather / transfer / release. A name that contains a layer index
(``…layers.N.…``, ``…h.N.…``, ``…blocks.N.…``) belongs to the group named by everything up to and
including that index, so a vision tower's layers and the language model's layers stay apart::

    >>> weight_group("model.layers.3.mlp.experts.7.down_proj.weight")
    'model.layers.3'
    >>> weight_group("model.embed_tokens.weight"), weight_group("lm_head.weight")
    ('pre', 'post')

A group larger than the sync's memory budget is split into parts ``<group>#<k>`` (``plan/split.py``); parts sort
right after one another, in part order, where their group would::

    >>> group_order(["post", "model.layers.1", "model.layers.0#1", "model.layers.0#0"])
    ['model.layers.0#0', 'model.layers.0#1', 'model.layers.1', 'post']
"""

from __future__ import annotations

import re
from typing import Iterable

__all__ = ["weight_group", "group_order", "base_group", "PRE", "POST", "PART"]

PRE, POST = "pre", "post"
PART = "#"
"""Between a split group's name and its part's index."""
_LAYER = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+))(?:\.|$)")
_PRE_HINTS = ("embed", "wte", "wpe", "word_embeddings", "tok_embeddings", "patch_embed")


def weight_group(name: str) -> str:
    """The weight group of one checkpoint name (HF naming of Llama, Qwen2/3(-MoE), Mixtral,
    DeepSeek-V2/V3, Llama-4, Phi-3 and most decoder-only models)."""
    m = _LAYER.match(name)
    if m:
        return m.group(1)
    leaf = name.lower()
    if any(h in leaf for h in _PRE_HINTS):
        return PRE
    return POST


def base_group(group: str) -> str:
    """The weight group a part belongs to (the group itself when it is not a part)."""
    return group.split(PART, 1)[0]


def _key(group: str) -> tuple:
    base, _, part = group.partition(PART)
    k = int(part) if part.isdigit() else -1
    if base == PRE:
        return (0, "", 0, k)
    if base == POST:
        return (2, "", 0, k)
    m = _LAYER.match(base)
    if not m:
        return (3, base, 0, k)  # a group named by its recorder (``record_plan(group_of=)``): after the known ones
    prefix = base[: m.start(2)]
    return (1, prefix, int(m.group(2)), k)


def group_order(groups: Iterable[str]) -> list[str]:
    """Transfer order: ``pre``, then layers by (prefix, index), then ``post``."""
    return sorted(set(groups), key=_key)
