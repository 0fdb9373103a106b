"""Where a verl sync group finds its coordinator: a tiny token-checked service on trainer rank 0.

verl exchanges addresses once per weight update, through ``prepare`` → ``build_topology`` →
``init_process_group``, all BEFORE the trainer's weights generator exists; shardsync's producers need the
model's metadata (which only that generator gives) before they bind their coordinator. So trainer rank 0
binds this service in ``prepare`` (a free port the OS picks) and, once its producer is up, publishes the
coordinator address and the version it is about to serve. Every other rank (trainer ranks > 0, rollout
workers) polls it until a version newer than the one it holds appears, within a deadline::

    rv = Rendezvous(host="10.0.0.1", token=token)          # trainer rank 0, in prepare()
    rv.publish(coordinator=producer.address, version=3)
    info = lookup(rv.address, token, after=2, timeout_s=60, who="rollout 1")   # anyone else

The service is the engine's own control server (``engine/protocol/control.py``: the token handshake before any
frame, size-limited msgpack frames, idle and unauthenticated connections timed out), answering one
message: ``Lookup`` → ``Published(coordinator=[host, port] | None, version=n)``. A wrong token gets nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...engine.protocol import messages as m
from ...engine.protocol.control import ControlClient, ControlServer
from ...errors import AuthError, SyncError, TransportError

__all__ = ["Rendezvous", "lookup"]

MAX_FRAME = 4096
"""Largest frame either side accepts (a ``Published`` is tens of bytes)."""


class Rendezvous:
    """Trainer rank 0's side: answers lookups with what was last published."""

    def __init__(self, *, host: str, token: str, io_timeout_s: float = 5.0):
        self._state = m.Published(coordinator=None, version=0)
        self._lock = threading.Lock()
        self._server = ControlServer(host, 0, token, self._handle, max_frame_bytes=MAX_FRAME,
                                     idle_timeout_s=io_timeout_s, auth_timeout_s=io_timeout_s, name="verl-rendezvous")
        self.address = self._server.address

    def publish(self, *, coordinator: list[Any] | None, version: int) -> None:
        with self._lock:
            self._state = m.Published(coordinator=None if coordinator is None else list(coordinator),
                                      version=int(version))

    def _handle(self, msg: m.Msg) -> m.Msg:
        if not isinstance(msg, m.Lookup):
            raise SyncError(f"verl rendezvous: unexpected message {type(msg).__name__}")
        with self._lock:
            return self._state

    def close(self) -> None:
        self._server.close()


def lookup(address: list[Any], token: str, *, after: int, timeout_s: float, who: str,
           poll_s: float = 0.05) -> dict[str, Any]:
    """Poll trainer rank 0's rendezvous until it publishes a coordinator and a version > ``after``
    (``{"coordinator": [host, port], "version": n}``); raise TransportError naming what was waited for once
    ``timeout_s`` has passed, AuthError at once if the rendezvous refuses the token."""
    deadline = time.monotonic() + timeout_s
    peer = "trainer rank 0's rendezvous"
    last = "no answer"
    client: ControlClient | None = None
    try:
        while True:
            step = max(0.1, min(5.0, deadline - time.monotonic()))
            try:
                if client is None:
                    client = ControlClient(address, token, peer=peer, connect_timeout_s=step, max_frame_bytes=MAX_FRAME)
                reply = client.call(m.Lookup(), timeout_s=step)
                if not isinstance(reply, m.Published):
                    raise TransportError(f"{peer} answered {type(reply).__name__}, expected Published")
                if reply.coordinator and reply.version > after:
                    return {"coordinator": list(reply.coordinator), "version": reply.version}
                last = f"it published version {reply.version}"
            except AuthError:
                raise AuthError(f"rendezvous at {address[0]}:{address[1]} refused the group's token") from None
            except TransportError as e:  # not up yet, restarting, or a broken connection: ask again
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() + poll_s > deadline:
                raise TransportError(
                    f"{who}: waited {timeout_s:.1f} s for trainer rank 0 (rendezvous {address[0]}:{address[1]}) to "
                    f"publish a weight version newer than {after}; last: {last}")
            time.sleep(poll_s)
    finally:
        if client is not None:
            client.close()
