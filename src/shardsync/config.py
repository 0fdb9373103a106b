"""The group-wide settings, declared once: what every member of one sync group runs with.

Every surface embeds :class:`GroupSettings` rather than copying its fields: ``ProducerConfig`` and vLLM's init
infos (``ShardsyncTrainerInitInfo``, ``ShardsyncInitInfo``) inherit it, ``Consumer``, verl's checkpoint engine and
the Ray helpers take its fields by keyword (or a ``settings=`` object), and the trainer side hands the consumers
its own settings (``to_dict``: in vLLM's init payload, verl's topology, the Ray registry). A new group-wide setting
is one field here; ``tests/house/test_settings_reach.py`` checks that every surface reaches every field.

    s = GroupSettings(token=token, transport="nixl", mac=True)
    ProducerConfig(rank=0, n_producers=1, n_consumers=2, **s.fields())
    Consumer("r0/rank0", coordinator, record=rec, apply=app, settings=s)

Old names keep working (:data:`ALIASES`: ``require_mac`` is ``mac``). Pure data: no torch, no processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["GroupSettings", "ALIASES", "DEFAULT_MAX_FRAME", "GROUP_FIELDS", "resolve_aliases", "settings_of",
           "split_settings"]

DEFAULT_MAX_FRAME = 256 << 20
"""Largest control frame either side accepts before allocating it (a plan of a very large model fits)."""


@dataclass(kw_only=True)
class GroupSettings:
    token: str = field(default="", repr=False)
    """The group's shared secret: every control and data connection proves it (never in ``repr``, logs or errors).
    On the trainer surfaces an empty token means: generate one and hand it to the consumers."""
    transport: str = "tcp"
    """How chunks move: ``tcp``, ``nccl``, ``nixl``, ``cuda_ipc``, ``rdt``, ``loopback`` or ``auto``
    (``transport/``)."""
    transport_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of that transport (``make_transport(transport, **transport_kwargs)``) on every member."""
    timeout_s: float = 120.0
    """Bound on every wait during a sync for a peer that is alive but slow."""
    init_timeout_s: float = 600.0
    """Bound on init waits (peers start engines, record and validate plans: slower than a sync)."""
    lease_s: float = 10.0
    """A peer that sends no heartbeat for this long is dead: the bound on detecting a dead consumer or producer."""
    verify_checksums: bool | None = None
    """xxh3-64 checksums of every chunk. Producers: None = on where the ring is in host memory, off for a GPU ring.
    Consumers check every checksum that comes; True makes them demand one (``ChecksumError``)."""
    mac: bool = False
    """For networks an attacker can write to: keyed chunk tags (``security/chunkmac.py``) replacing the checksums
    and a MAC on every control frame (``security/framemac.py``). Every member must agree: a producer with it refuses
    members without, a consumer with it refuses producers without (``AuthError``, ``ChunkMacError``). Costs a keyed
    hash of every byte on both sides (``benchmarks/checksum_cost.py``)."""
    delta: bool | str = False
    """Delta sync (``delta/``, ``docs/delta.md``): producers offer the words that changed since the version a
    consumer holds beside the dense bytes; consumers keep a held copy (none of the chunks an engine writes as they
    come: ``Consumer(read_back=)``, the parameters are the base) and read only the changes — where it pays.
    ``True``: a consumer that maps a producer's ring on its own device (colocated, ``cuda_ipc``: the dense read runs
    at memory speed) reads that producer dense, with no held copy, and a producer encodes only chunks some member
    reads as deltas. ``"always"``: every delta consumer reads deltas from every producer. Costs, on the ring's device:
    a delta area per ring slot and the history of served chunks (``delta_budget_bytes``), allocated at the first
    encode, plus an encode pass per chunk and its checksum (on a GPU, ``kernels/word_hash.py``: no host copy)."""
    sync_memory_bytes: int | None = None
    """The sync's transient memory budget: consumers split weight groups above half of it into parts
    (``plan/split.py``), so a trainer's ring (``lookahead + 1`` slots of one part of every plan) and an engine's
    receive slots hold parts, not whole layers. None: the smaller of 10 % of the model's bytes and 1 GiB; 0: groups
    are never split."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    """Largest control frame accepted, checked before it is allocated (engine rule 5)."""
    switch_interval_s: float | None = 0.0002
    """While a sync runs, the process's GIL switch interval (and the cyclic GC is paused); restored afterwards.
    None leaves the interpreter alone (``engine/lanes.hot_path``)."""

    def __post_init__(self) -> None:
        if self.delta not in (False, True, "always") or type(self.delta) not in (bool, str):
            raise ValueError(f"delta={self.delta!r}: expected False, True (where it pays) or 'always'")

    def fields(self) -> dict[str, Any]:
        """The settings as keyword arguments (``transport_kwargs`` copied)."""
        out = {f: getattr(self, f) for f in GROUP_FIELDS}
        out["transport_kwargs"] = dict(out["transport_kwargs"] or {})
        return out

    def to_dict(self) -> dict[str, Any]:
        """What the trainer side hands its consumers (JSON-able; the token included: it travels on channels the
        trainer already trusts — vLLM's init payload, verl's topology, the Ray registry)."""
        return self.fields()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "settings") -> "GroupSettings":
        """The inverse of :meth:`to_dict`; an unknown name is a ``TypeError`` naming it (aliases accepted)."""
        found, rest = split_settings(dict(d), where=where)
        if rest:
            raise TypeError(f"{where}: unknown group setting(s) {sorted(rest)[:8]}; known: {list(GROUP_FIELDS)}")
        return found


GROUP_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GroupSettings))
"""Every group-wide setting's name, in declaration order."""

ALIASES: dict[str, str] = {"require_mac": "mac"}
"""Names users already write, and the setting each one means."""


def resolve_aliases(kw: dict[str, Any], *, where: str) -> dict[str, Any]:
    """``kw`` with every old name (:data:`ALIASES`) replaced by its setting's name; both given with different values
    is a ``TypeError`` naming both."""
    out: dict[str, Any] = {}
    said: dict[str, str] = {}
    for k, v in kw.items():
        name = ALIASES.get(k, k)
        if name in out and out[name] != v:
            raise TypeError(f"{where}: {said[name]}={out[name]!r} and {k}={v!r} name one setting ({name}) twice")
        out[name], said[name] = v, k
    return out


def settings_of(obj: Any) -> GroupSettings:
    """The group settings an object embeds (a ``ProducerConfig``, an init info, a ``GroupSettings``)."""
    return GroupSettings(**{f: getattr(obj, f) for f in GROUP_FIELDS})


def split_settings(kw: dict[str, Any], *, where: str, base: GroupSettings | None = None
                   ) -> tuple[GroupSettings, dict[str, Any]]:
    """Split keyword arguments into the group settings they name (on top of ``base``) and the rest.

    An alias and its setting both given with different values is a ``TypeError`` naming both."""
    vals = base.fields() if base is not None else {}
    kw = resolve_aliases(kw, where=where)
    vals.update({k: v for k, v in kw.items() if k in GROUP_FIELDS})
    rest = {k: v for k, v in kw.items() if k not in GROUP_FIELDS}
    if vals.get("transport_kwargs") is None:
        vals["transport_kwargs"] = {}
    return GroupSettings(**vals), rest
