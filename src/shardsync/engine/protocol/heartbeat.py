"""Lease renewal: a background thread that renews one peer's lease with the coordinator.

Every ``lease_s / 4`` it sends ``Renew``; the reply (``Lease``) says which consumers were dropped,
which producers are dead and which versions failed — that is how peers learn of each other's death
within the lease bound without any collective. If the coordinator cannot be reached for ``lease_s``,
``view()`` raises: the group has lost its coordinator and every sync fails fast. A ``ConsumerDropped``
reply (this consumer's lease expired, e.g. it was paused) calls ``on_dropped`` — the consumer rejoins, or, when
another session took its id meanwhile (displaced), stops this heartbeat (``stop()`` may be called from
``on_dropped``). A refusal of a renewal that was replaced meanwhile (``set_renew``: the peer joined again while it
was in flight) is stale and ignored; ``refused`` is the renewal the coordinator last refused::

    hb = Heartbeat(coordinator, token, Renew(consumer=cid, session=s), lease_s=10, who="consumer r0/tp0")
    hb.view()    # {"dead": [[cid, session, why]], "dead_producers": {rank: [incarnation, why]}, "failed": {version: why}}
    hb.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from . import messages as m
from .control import ControlClient
from ...errors import ConsumerDropped, ShardsyncError, TransportError

__all__ = ["Heartbeat"]
log = logging.getLogger("shardsync.heartbeat")


class Heartbeat:
    def __init__(self, coordinator: list[Any], token: str, renew: m.Renew, *, lease_s: float, who: str,
                 on_change: Callable[[], None] | None = None, on_dropped: Callable[[str], None] | None = None,
                 require_mac: bool = False):
        self.renew, self.lease_s, self.who = renew, lease_s, who
        self.on_change, self.on_dropped = on_change, on_dropped
        self._client = ControlClient(coordinator, token, peer="coordinator (producer 0)", connect_timeout_s=lease_s,
                                     require_mac=require_mac)
        self._view: dict[str, Any] = {"dead": [], "dead_producers": {}, "left": [], "failed": {}}
        self._last_ok = time.monotonic()
        self._error = ""
        self.dropped = ""
        self.refused: m.Renew | None = None
        """The renewal the coordinator last refused with ``ConsumerDropped`` (``on_dropped`` may check that it is
        the peer's current session)."""
        self._failing = ""  # the last rejoin failure logged with its traceback (a repeat is one line)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardsync-heartbeat-{who}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = self.lease_s / 4
        while not self._stop.wait(period):
            renew = self.renew
            try:
                lease = self._client.call(renew, timeout_s=self.lease_s)
                self._view = {"dead": lease.dead, "dead_producers": lease.dead_producers, "left": lease.left,
                              "failed": lease.failed}
                self._last_ok, self._error = time.monotonic(), ""
            except ConsumerDropped as e:  # the coordinator is there; this peer's lease is not
                if renew is not self.renew or self._stop.is_set():
                    continue  # stale: the peer joined again (or stopped) while this renewal was in flight
                self._last_ok, self.dropped, self.refused = time.monotonic(), str(e), renew
                if self.on_dropped is not None:
                    try:
                        self.on_dropped(str(e))
                        self._failing = ""
                    except Exception as x:  # retried at the next renewal: the traceback once, then one line each
                        if str(x) != self._failing:
                            self._failing = str(x)
                            log.exception("%s: rejoin after being dropped failed", self.who)
                        else:
                            log.warning("%s: rejoin after being dropped failed again: %s", self.who, x)
            except ShardsyncError as e:
                self._error = str(e)
            except Exception:  # never die silently: a dead heartbeat would look like a dead peer
                log.exception("%s: heartbeat failed", self.who)
            if self.on_change is not None:
                self.on_change()

    def set_renew(self, renew: m.Renew) -> None:
        self.renew = renew  # a rejoined consumer renews its new session
        self._last_ok, self._error, self.dropped = time.monotonic(), "", ""

    def view(self) -> dict[str, Any]:
        if self._error and time.monotonic() - self._last_ok > self.lease_s:
            raise TransportError(f"{self.who}: lost the coordinator (producer 0): no lease renewal for "
                                 f"{self.lease_s:g} s: {self._error}; the group must be restarted")
        return self._view

    def stop(self, *, wait: bool = True) -> None:
        """Stop renewing; ``wait``: for the thread to end (never from ``on_dropped``, on the thread itself)."""
        self._stop.set()
        self._client.close()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
