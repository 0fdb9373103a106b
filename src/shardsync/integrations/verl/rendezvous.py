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

The wire is one JSON line each way (``{"token": ...}`` → ``{"coordinator": [host, port] | null, "version":
n}``), bounded in size and time; a wrong token gets nothing.
"""

from __future__ import annotations

import hmac
import json
import socket
import threading
import time
from typing import Any

from ...errors import AuthError, TransportError

__all__ = ["Rendezvous", "lookup"]

MAX_LINE = 4096


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        part = sock.recv(MAX_LINE)
        if not part:
            break
        data += part
        if len(data) > MAX_LINE:
            raise TransportError(f"rendezvous line longer than {MAX_LINE} bytes")
    return data


class Rendezvous:
    """Trainer rank 0's side: answers lookups with what was last published."""

    def __init__(self, *, host: str, token: str, io_timeout_s: float = 5.0):
        self.token, self.io_timeout_s = token, io_timeout_s
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.address = [host, self._sock.getsockname()[1]]
        self._state: dict[str, Any] = {"coordinator": None, "version": 0}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="shardsync-verl-rendezvous", daemon=True)
        self._thread.start()

    def publish(self, *, coordinator: list[Any] | None, version: int) -> None:
        with self._lock:
            self._state = {"coordinator": None if coordinator is None else list(coordinator), "version": int(version)}

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(self.io_timeout_s)
                    req = json.loads(_read_line(conn) or b"{}")
                    if not isinstance(req, dict) or not hmac.compare_digest(str(req.get("token", "")), self.token):
                        conn.sendall(b'{"error": "bad token"}\n')
                        continue
                    with self._lock:
                        reply = dict(self._state)
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except (OSError, ValueError, TransportError):
                    continue  # a broken or malformed peer gets nothing; it retries or times out

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(timeout=2)


def _ask(address: list[Any], token: str, timeout_s: float) -> dict[str, Any]:
    with socket.create_connection((address[0], int(address[1])), timeout=timeout_s) as s:
        s.settimeout(timeout_s)
        s.sendall(json.dumps({"token": token}).encode() + b"\n")
        reply = json.loads(_read_line(s) or b"{}")
    if not isinstance(reply, dict):
        raise TransportError(f"rendezvous at {address[0]}:{address[1]} answered {reply!r}")
    if "error" in reply:
        raise AuthError(f"rendezvous at {address[0]}:{address[1]} refused the group's token")
    return reply


def lookup(address: list[Any], token: str, *, after: int, timeout_s: float, who: str,
           poll_s: float = 0.05) -> dict[str, Any]:
    """Poll trainer rank 0's rendezvous until it publishes a coordinator and a version > ``after``; raise
    TransportError naming what was waited for once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            reply = _ask(address, token, max(0.1, min(5.0, left)))
            if reply.get("coordinator") and int(reply.get("version", 0)) > after:
                return reply
            last = f"it published version {reply.get('version', 0)}"
        except AuthError:
            raise
        except (OSError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() + poll_s > deadline:
            raise TransportError(
                f"{who}: waited {timeout_s:.1f} s for trainer rank 0 (rendezvous {address[0]}:{address[1]}) to "
                f"publish a weight version newer than {after}; last: {last}")
        time.sleep(poll_s)
