"""Start shardsync's producers and consumers inside Ray actors, wired to each other through the group registry.

Every process binds to its node's address (``ray.util.get_node_ip_address()``) on a free port and tells the
coordinator its Ray node id, so that an engine reads from a producer on its own node whenever one holds the
bytes (``plan/route.py`` rule 5); producer 0
publishes its coordinator address, a fresh token and the transport under the group's name; other producers
and every engine look them up. A dead engine actor is dropped from the sync in progress once its lease
expires (``lease_s``) and rejoins at the next version when it is restarted under the same consumer id (the
engine machinery of ``engine/``)::

    @ray.remote
    class Trainer:
        def __init__(self, rank, n):
            self.producer = start_producer(make_source(rank), group="policy", rank=rank, n_producers=n,
                                           n_consumers=4, lease_s=5)
        def init(self): self.producer.init()
        def step(self, v): ...; return self.producer.sync(v)
"""

from __future__ import annotations

import secrets
from typing import Any

import ray

from ...config import GroupSettings, settings_of, split_settings
from ...engine.consumer.consumer import Consumer
from ...engine.producer.producer import Producer
from ...engine.producer.producer_config import ProducerConfig, producer_options
from .registry import lookup, publish

__all__ = ["start_producer", "start_consumer", "engine_init_info", "producer_config", "group_entry",
           "consumer_settings"]

_RESERVED = ("rank", "n_producers", "n_consumers", "host", "coordinator")


def node_address() -> str:
    """This process's Ray node address (what its servers bind and advertise); ``127.0.0.1`` outside Ray."""
    try:
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


def producer_config(cfg: dict[str, Any], *, rank: int, n_producers: int, n_consumers: int, host: str,
                    registry: dict[str, Any] | None = None) -> ProducerConfig:
    """A rank's producer config from ``start_producer``'s keyword arguments: the group's settings (rank 0: the given
    ones, a fresh token unless one is given; the others: the registry's, where ``cfg`` names none) and the rank's own
    ``ProducerConfig`` fields."""
    base = GroupSettings.from_dict(registry["settings"], where="the group registry") if registry else None
    settings, own = split_settings(dict(cfg), where="start_producer", base=base)
    if rank == 0 and not settings.token:
        settings.token = secrets.token_hex(16)
    own = producer_options(own, where="start_producer", reserved=_RESERVED)
    return ProducerConfig(**settings.fields(), **own, rank=rank, n_producers=n_producers, n_consumers=n_consumers,
                          host=host, coordinator=registry["coordinator"] if registry else None)


def group_entry(p: ProducerConfig, address: Any) -> dict[str, Any]:
    """What producer 0 publishes under the group's name: its address, the group's settings (token included: the
    registry is Ray's, inside the cluster) and the group's sizes."""
    s = settings_of(p)
    return {"coordinator": list(address), "token": p.token, "transport": p.transport, "settings": s.to_dict(),
            "n_producers": p.n_producers, "n_consumers": p.n_consumers}


def consumer_settings(info: dict[str, Any], kw: dict[str, Any]) -> tuple[GroupSettings, dict[str, Any]]:
    """An engine's settings: the group's (from the registry), with what the caller names on top; and the rest."""
    return split_settings(dict(kw), where="start_consumer",
                          base=GroupSettings.from_dict(info["settings"], where="the group registry"))


def start_producer(source: Any, *, group: str, rank: int, n_producers: int, n_consumers: int,
                   lookup_timeout_s: float = 120.0, **cfg: Any) -> Producer:
    """A producer for this trainer actor (not yet ``init()``-ed: init waits for the consumers). ``cfg``: any group
    setting (``GroupSettings``: ``transport``, ``lease_s``, ``mac``, ``delta``, ...; rank 0's are the group's, the
    other ranks and the engines take them from the registry) or ``ProducerConfig`` field (``lookahead``,
    ``device``, ...)."""
    host = ray.util.get_node_ip_address()
    cfg.setdefault("node", ray.get_runtime_context().get_node_id())  # same-node consumers read from it first
    if rank == 0:
        p = Producer(source, producer_config(cfg, rank=0, n_producers=n_producers, n_consumers=n_consumers,
                                             host=host))
        publish(group, group_entry(p.cfg, p.address))
        return p
    info = lookup(group, timeout_s=lookup_timeout_s)
    return Producer(source, producer_config(cfg, rank=rank, n_producers=n_producers, n_consumers=n_consumers,
                                            host=host, registry=info))


def start_consumer(consumer_id: str, *, group: str, record: Any, apply: Any, lookup_timeout_s: float = 120.0,
                   **kw: Any) -> Consumer:
    """A consumer for an engine of your own (``record``/``apply`` as for :class:`Consumer`), not yet ``init()``-ed;
    ``kw``: ``Consumer`` options, and group settings that override the group's own."""
    info = lookup(group, timeout_s=lookup_timeout_s)
    kw.setdefault("node", ray.get_runtime_context().get_node_id())
    settings, rest = consumer_settings(info, kw)
    return Consumer(consumer_id, info["coordinator"], record=record, apply=apply, settings=settings, **rest)


def engine_init_info(group: str, *, lookup_timeout_s: float = 120.0, **extra: Any) -> dict[str, Any]:
    """The shardsync init info (pull mode) for a vLLM engine of this group: pass it as ``init_info`` to
    ``LLM.init_weight_transfer_engine`` (``extra``: other ``ShardsyncInitInfo`` fields, group settings among them,
    which override the group's)."""
    info = lookup(group, timeout_s=lookup_timeout_s)
    return {**info["settings"], "coordinator": info["coordinator"], **extra}
