"""Where a sync group's coordinator is: a small named Ray actor per group (namespace ``shardsync``) holding
producer 0's address, the group's token and transport. Producer 0 publishes; everyone else looks it up by
the group's name, waiting (bounded) until it has been published::

    publish("policy", {"coordinator": ["10.0.0.5", 41234], "token": "...", "transport": "tcp"})
    lookup("policy", timeout_s=60)["coordinator"]
    forget("policy")      # the run is over: the registry actor goes away
"""

from __future__ import annotations

import time
from typing import Any

import ray

from ...errors import SyncError

__all__ = ["publish", "lookup", "forget", "NAMESPACE"]

NAMESPACE = "shardsync"


@ray.remote(num_cpus=0)
class _Registry:
    def __init__(self) -> None:
        self.info: dict[str, Any] | None = None

    def put(self, info: dict[str, Any]) -> None:
        self.info = dict(info)

    def get(self) -> dict[str, Any] | None:
        return self.info

    def node(self) -> str:
        """The Ray node id this registry runs on (it must be producer 0's: ``publish``)."""
        return ray.get_runtime_context().get_node_id()


def _name(group: str) -> str:
    return f"sync-group:{group}"


def publish(group: str, info: dict[str, Any]) -> None:
    """Record the group's coordinator (replacing an earlier one: a restarted producer 0). The registry actor is
    pinned to the caller's node (producer 0's, where the coordinator runs): left to Ray it could land on an engine's
    node and die with it, and engines restarted after that node's loss would wait out ``lookup``'s bound for a name
    that no longer exists. The pin is hard: a *soft* node affinity did not hold on Ray 2.60 — a 0-CPU actor asked
    for on producer 0's node landed on other raylets (3 of 5 placements measured, the head included), so a removed
    engine node took the registry with it. The actor needs no resources, so the caller's (live) node always fits
    it; if that node dies, the coordinator died with it and a restarted producer 0 publishes again."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    reg = _Registry.options(name=_name(group), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                            scheduling_strategy=here).remote()
    ray.get(reg.put.remote(info))


def lookup(group: str, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """The group's coordinator info, once producer 0 has published it (waits up to ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = ray.get(ray.get_actor(_name(group), namespace=NAMESPACE).get.remote(), timeout=timeout_s)
        except ValueError:  # not created yet
            info = None
        if info is not None:
            return info
        if time.monotonic() > deadline:
            raise SyncError(f"sync group {group!r}: no producer 0 published its coordinator within {timeout_s} s "
                            f"(Ray namespace {NAMESPACE!r}, actor {_name(group)!r})")
        time.sleep(0.2)


def forget(group: str) -> None:
    try:
        ray.kill(ray.get_actor(_name(group), namespace=NAMESPACE))
    except ValueError:
        pass
