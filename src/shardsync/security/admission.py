"""Accepting connections from peers that are not trusted yet: the accept loop every shardsync server runs.

* The loop never stops on a transient error: ``EMFILE``/``ENFILE`` (out of file descriptors: a flood, or a large
  job), ``ENOBUFS``/``ENOMEM``, a connection reset before it was accepted, a thread that could not start — it logs
  (at most once a second), backs off (up to 1 s) and goes on. It stops only when its server is closed.
* Unauthenticated connections are capped: ``max_pending`` in all and ``max_per_source`` from one address. Over a
  cap the OLDEST such connection (of that address, else of all) is cut, not the new one: a legitimate peer's
  handshake takes milliseconds, so a flood of idle connections cannot lock legitimate peers out (on loopback every
  peer has the same address), and the threads serving handshakes stay bounded.
* A handshake has ONE wall-clock deadline (``deadline_s`` from accept), not a per-``recv`` timeout: a peer that drips
  a byte at a time is cut off when it expires (a watchdog thread shuts its socket down).
* Refusals are counted by reason (``refused``) and logged, rate-limited.

    admission = Admission("control", deadline_s=10.0)
    threading.Thread(target=accept_loop, args=(server_sock, closed, serve, "control", admission)).start()
    def serve(conn):            # on its own thread
        try:
            if not handshake(conn): return
            admission.passed(conn)     # authenticated: no longer counted, no deadline
            ...
        finally:
            admission.release(conn)    # idempotent
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections import defaultdict
from typing import Any, Callable

__all__ = ["Admission", "accept_loop", "MAX_PENDING", "MAX_PER_SOURCE"]
log = logging.getLogger("shardsync.admission")

MAX_PENDING = 128
"""Unauthenticated connections one server holds at once."""
MAX_PER_SOURCE = 32
"""Unauthenticated connections one source address holds at once."""
_FATAL = {errno.EBADF, errno.EINVAL, errno.ENOTSOCK}
"""accept() errors that mean the listening socket itself is gone."""


class _RateLimited:
    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s, self._last, self.suppressed = every_s, 0.0, 0

    def __call__(self, level: int, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return
        extra = f" ({self.suppressed} similar suppressed)" if self.suppressed else ""
        self._last, self.suppressed = now, 0
        log.log(level, msg + extra, *args)


class Admission:
    """Bookkeeping of a server's not-yet-authenticated connections (see the module docstring)."""

    def __init__(self, name: str, *, deadline_s: float = 10.0, max_pending: int = MAX_PENDING,
                 max_per_source: int = MAX_PER_SOURCE) -> None:
        self.name, self.deadline_s = name, deadline_s
        self.max_pending, self.max_per_source = max_pending, max_per_source
        self.refused: dict[str, int] = defaultdict(int)
        """Refusals by reason: ``capacity`` (cut: over a cap), ``deadline`` (handshake too slow), ``token`` (wrong
        token; counted by the server through :meth:`refuse`), ``mac`` (a control frame whose MAC is wrong: its
        connection is closed), ``accept_error`` (transient accept failures), ``no_thread`` (no thread could be
        started)."""
        self._pending: dict[socket.socket, tuple[str, float]] = {}
        self._per_source: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._log = _RateLimited()
        self._watchdog: threading.Thread | None = None

    def admit(self, conn: socket.socket, addr: Any) -> None:
        """Count ``conn`` as unauthenticated (deadline from now); over a cap, cut the oldest such connection."""
        src = str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)
        with self._lock:
            victim = None
            if self._per_source[src] >= self.max_per_source:
                victim = next((c for c, (s_, _) in self._pending.items() if s_ == src), None)
            elif len(self._pending) >= self.max_pending:
                victim = next(iter(self._pending), None)
            self._pending[conn] = (src, time.monotonic() + self.deadline_s)
            self._per_source[src] += 1
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name=f"shardsync-{self.name}-handshakes",
                                                  daemon=True)
                self._watchdog.start()
        if victim is not None:
            self._cut(victim, "capacity", f"{src} (caps {self.max_pending} unauthenticated connections, "
                                          f"{self.max_per_source} per address: the oldest is cut)")

    def passed(self, conn: socket.socket) -> None:
        """The connection authenticated: it leaves the caps and its deadline."""
        self._forget(conn)

    def release(self, conn: socket.socket) -> None:
        self._forget(conn)

    def refuse(self, reason: str, peer: Any = "") -> None:
        self.refused[reason] += 1
        self._log(logging.WARNING, "%s: refused %s (%s); %s", self.name, peer or "a connection", reason,
                  dict(self.refused))

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._closed.set()

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            entry = self._pending.pop(conn, None)
            if entry is not None:
                self._per_source[entry[0]] -= 1
                if self._per_source[entry[0]] <= 0:
                    del self._per_source[entry[0]]

    def _cut(self, conn: socket.socket, reason: str, peer: str) -> None:
        self._forget(conn)
        self.refuse(reason, peer)
        try:
            conn.shutdown(socket.SHUT_RDWR)  # the serving thread's recv returns; it closes the socket
        except OSError:
            pass

    def _watch(self) -> None:
        while not self._closed.wait(0.1):
            now = time.monotonic()
            with self._lock:
                late = [(c, src) for c, (src, dl) in self._pending.items() if dl <= now]
            for c, src in late:
                self._cut(c, "deadline", f"{src} (no handshake within {self.deadline_s:g} s)")


def accept_loop(server: socket.socket, closed: threading.Event, serve: Callable[[socket.socket], None], name: str,
                admission: Admission) -> None:
    """Accept until ``closed`` (``server`` has a short timeout); each admitted connection is served on its own
    thread. Survives every transient error (see the module docstring)."""
    backoff = 0.0
    while not closed.is_set():
        try:
            conn, addr = server.accept()
        except socket.timeout:
            continue
        except OSError as e:
            if closed.is_set():
                return
            if e.errno in _FATAL:
                log.error("%s: the listening socket is gone (%s); accepting stops", name, e)
                return
            admission.refused["accept_error"] += 1
            backoff = min(1.0, backoff * 2 or 0.01)
            admission._log(logging.WARNING, "%s: accept failed (%s); retrying in %.2f s", name, e, backoff)
            closed.wait(backoff)
            continue
        backoff = 0.0
        admission.admit(conn, addr)
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # half-open peers are found by the OS
            threading.Thread(target=serve, args=(conn,), name=name, daemon=True).start()
        except (RuntimeError, OSError) as e:  # no thread (or the peer already left): drop it, go on
            admission.release(conn)
            conn.close()
            admission.refuse("no_thread" if isinstance(e, RuntimeError) else "accept_error", addr)
            closed.wait(0.05)
