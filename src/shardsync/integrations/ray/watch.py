"""Wire Ray actor death into the sync group: a dead engine actor's consumers are dropped at once.

A thread keeps one ``__ray_ready__`` ping in flight per watched actor (every Ray actor has that method; a
busy actor just answers later). Ray fails a dead actor's calls with ``RayActorError``; the watch then
sends ``Evict`` for that actor's consumer ids to the group's coordinator (authenticated by the group token),
which drops them from the version in progress like an expired lease — without waiting ``lease_s``. A
restarted actor is watched again with ``watch``; its consumers rejoin at the next version::

    w = EngineWatch("policy")
    w.watch(engine_actor, ["replica0/rank0", "replica0/rank1"])
    ...
    w.stop()
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray
from ray.exceptions import RayActorError

from ...engine.protocol import messages as m
from ...engine.protocol.control import ControlClient
from .registry import lookup

__all__ = ["EngineWatch"]
log = logging.getLogger("shardsync.integrations.ray.watch")


class EngineWatch:
    def __init__(self, group: str, *, interval_s: float = 0.2, lookup_timeout_s: float = 120.0):
        info = lookup(group, timeout_s=lookup_timeout_s)
        self.group, self.interval_s = group, interval_s
        self.client = ControlClient(info["coordinator"], info["token"], peer=f"coordinator of {group!r}")
        self.evicted: list[tuple[str, str]] = []
        """(consumer id, why) for every consumer reported dead."""
        self._lock = threading.Lock()
        self._actors: dict[Any, tuple[Any, list[str]]] = {}  # actor id -> (handle, consumer ids)
        self._pings: dict[Any, Any] = {}  # actor id -> ping ref in flight
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardsync-watch-{group}", daemon=True)
        self._thread.start()

    def watch(self, actor: Any, consumer_ids: list[str]) -> None:
        with self._lock:
            self._actors[actor._actor_id] = (actor, list(consumer_ids))

    def unwatch(self, actor: Any) -> None:
        with self._lock:
            self._actors.pop(actor._actor_id, None)
            self._pings.pop(actor._actor_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                for aid, (actor, _) in self._actors.items():
                    if aid not in self._pings:
                        self._pings[aid] = actor.__ray_ready__.remote()
                refs = {ref: aid for aid, ref in self._pings.items()}
            if not refs:
                self._stop.wait(self.interval_s)
                continue
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.interval_s)
            for ref in done:
                aid = refs[ref]
                try:
                    ray.get(ref)
                except RayActorError as e:
                    self._evict(aid, f"Ray actor {aid.hex()[:12]} died: {str(e).splitlines()[0][:200]}")
                    continue
                except Exception:
                    pass
                with self._lock:
                    self._pings.pop(aid, None)
            if len(done) == len(refs):  # everyone answered at once: pace the next round
                self._stop.wait(self.interval_s)

    def _evict(self, aid: Any, why: str) -> None:
        with self._lock:
            entry = self._actors.pop(aid, None)
            self._pings.pop(aid, None)
        if entry is None:
            return
        try:
            self.client.call(m.Evict(consumers=entry[1], reason=why), timeout_s=10)
            self.evicted.extend((c, why) for c in entry[1])
        except Exception:
            log.exception("could not report %s dead to the coordinator (its lease will expire instead)", entry[1])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()
