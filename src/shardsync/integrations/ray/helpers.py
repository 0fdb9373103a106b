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

from ...engine.consumer.consumer import Consumer
from ...engine.producer.producer import Producer, ProducerConfig
from .registry import lookup, publish

__all__ = ["start_producer", "start_consumer", "engine_init_info"]


def start_producer(source: Any, *, group: str, rank: int, n_producers: int, n_consumers: int,
                   transport: str = "tcp", lookup_timeout_s: float = 120.0, **cfg: Any) -> Producer:
    """A producer for this trainer actor (not yet ``init()``-ed: init waits for the consumers). ``cfg``: any other
    :class:`ProducerConfig` field (``lease_s``, ``lookahead``, ``device``, ...)."""
    host = ray.util.get_node_ip_address()
    cfg.setdefault("node", ray.get_runtime_context().get_node_id())  # same-node consumers read from it first
    if rank == 0:
        token = cfg.pop("token", None) or secrets.token_hex(16)
        p = Producer(source, ProducerConfig(rank=0, n_producers=n_producers, n_consumers=n_consumers, token=token,
                                            host=host, transport=transport, **cfg))
        publish(group, {"coordinator": list(p.address), "token": token, "transport": transport,
                        "n_producers": n_producers, "n_consumers": n_consumers})
        return p
    info = lookup(group, timeout_s=lookup_timeout_s)
    return Producer(source, ProducerConfig(rank=rank, n_producers=n_producers, n_consumers=n_consumers,
                                           token=info["token"], host=host, coordinator=info["coordinator"],
                                           transport=info["transport"], **cfg))


def start_consumer(consumer_id: str, *, group: str, record: Any, apply: Any, lookup_timeout_s: float = 120.0,
                   **kw: Any) -> Consumer:
    """A consumer for an engine of your own (``record``/``apply`` as for :class:`Consumer`), not yet ``init()``-ed."""
    info = lookup(group, timeout_s=lookup_timeout_s)
    kw.setdefault("node", ray.get_runtime_context().get_node_id())
    return Consumer(consumer_id, info["coordinator"], token=info["token"], record=record, apply=apply,
                    transport=kw.pop("transport", info["transport"]), **kw)


def engine_init_info(group: str, *, lookup_timeout_s: float = 120.0, **extra: Any) -> dict[str, Any]:
    """The shardsync init info (pull mode) for a vLLM engine of this group: pass it as ``init_info`` to
    ``LLM.init_weight_transfer_engine`` (``extra``: other ``ShardsyncInitInfo`` fields)."""
    info = lookup(group, timeout_s=lookup_timeout_s)
    return {"coordinator": info["coordinator"], "token": info["token"], "transport": info["transport"], **extra}
