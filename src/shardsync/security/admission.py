"""Accepting connections from peers that are not trusted yet: the accept loop every shardsync server runs.

* The loop never stops on a transient error: ``EMFILE``/``ENFILE`` (out of file descriptors: a flood, or a large
  job), ``ENOBUFS``/``ENOMEM``, a connection reset before it was accepted, a thread that could not start — it logs
  (at most once a second), backs off (up to 1 s) and goes on. It stops only when its server is closed.
* Unauthenticated connections are capped: ``max_pending`` in all and ``max_per_source`` from one address. Over a
  cap the OLDEST such connection (of that address, else of all) is cut, not the new one: a legitimate peer's
  handshake takes milliseconds, so a flood of idle connections cannot lock legitimate peers out (on loopback every
  peer has the same address), and the threads serving handshakes stay bounded.
* Authenticated connections are capped too where a server asks (``max_authed``: the control servers; a token holder
  is still a peer): ``max_authed`` in all and
  ``max_authed_per_source`` from one address; over a cap the connection idle the longest (of that address, else of
  all) is cut — one being answered never is, and if every one is busy the new connection is refused. Clients
  reconnect on their next call, so a cut idle connection costs a legitimate peer one reconnect.
* A handshake has ONE wall-clock deadline (``deadline_s`` from accept), not a per-``recv`` timeout: a peer that drips
  a byte at a time is cut off when it expires (a watchdog thread shuts its socket down).
* Refusals are counted by reason (``refused``) and logged, rate-limited.

    admission = Admission("control", deadline_s=10.0)
    threading.Thread(target=accept_loop, args=(server_sock, closed, serve, "control", admission)).start()
    def serve(conn):            # on its own thread
        try:
            if not handshake(conn): return
            if not admission.passed(conn): return   # authenticated: no deadline; False: over the caps
            admission.busy(conn, True); ...; admission.busy(conn, False)   # around each request
        finally:
            admission.release(conn)    # idempotent
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections import defaultdict
from typing import Any, Callable

__all__ = ["Admission", "RateLimited", "accept_loop", "MAX_PENDING", "MAX_PER_SOURCE", "MAX_AUTHED", "MAX_AUTHED_PER_SOURCE"]
log = logging.getLogger("shardsync.admission")

MAX_PENDING = 128
"""Unauthenticated connections one server holds at once."""
MAX_PER_SOURCE = 32
"""Unauthenticated connections one source address holds at once."""
MAX_AUTHED = 1024
"""Authenticated connections (each a serving thread) one server holds at once."""
MAX_AUTHED_PER_SOURCE = 256
"""Authenticated connections one source address holds at once (a node's engines: a few per consumer and producer)."""
_FATAL = {errno.EBADF, errno.EINVAL, errno.ENOTSOCK}
"""accept() errors that mean the listening socket itself is gone."""


class RateLimited:
    """A log call that lets one message through per ``every_s`` and counts the ones it held back."""

    def __init__(self, every_s: float = 1.0, logger: logging.Logger | None = None) -> None:
        self.every_s, self._last, self.suppressed = every_s, 0.0, 0
        self.logger = logger or log

    def __call__(self, level: int, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return
        extra = f" ({self.suppressed} similar suppressed)" if self.suppressed else ""
        self._last, self.suppressed = now, 0
        self.logger.log(level, msg + extra, *args)


class Admission:
    """Bookkeeping of a server's not-yet-authenticated connections (see the module docstring)."""

    def __init__(self, name: str, *, deadline_s: float = 10.0, max_pending: int = MAX_PENDING,
                 max_per_source: int = MAX_PER_SOURCE, max_authed: int | None = None,
                 max_authed_per_source: int = MAX_AUTHED_PER_SOURCE) -> None:
        self.name, self.deadline_s = name, deadline_s
        self.max_pending, self.max_per_source = max_pending, max_per_source
        self.max_authed, self.max_authed_per_source = max_authed, max_authed_per_source
        self._authed: dict[socket.socket, list] = {}  # conn -> [source, last active (monotonic), busy]
        self.refused: dict[str, int] = defaultdict(int)
        """Refusals by reason: ``capacity`` (cut: over a cap), ``authed_capacity`` (an idle authenticated connection
        cut, or a new one refused, over the authenticated caps), ``deadline`` (handshake too slow), ``token`` (wrong
        token; counted by the server through :meth:`refuse`), ``mac`` (a control frame whose MAC is wrong: its
        connection is closed), ``accept_error`` (transient accept failures), ``no_thread`` (no thread could be
        started)."""
        self._pending: dict[socket.socket, tuple[str, float]] = {}
        self._per_source: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._log = RateLimited()
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

    def passed(self, conn: socket.socket) -> bool:
        """The connection authenticated: it leaves the handshake caps and its deadline and joins the authenticated
        ones; over their caps the longest-idle one is cut (False: every one is busy, refuse this one)."""
        with self._lock:
            src = self._pending.get(conn, ("?", 0.0))[0]
        self._forget(conn)
        if self.max_authed is None:  # authenticated connections not tracked (a data server: its own bounds)
            return True
        with self._lock:
            mine = [c for c, e in self._authed.items() if e[0] == src]
            pool = mine if len(mine) >= self.max_authed_per_source else \
                list(self._authed) if len(self._authed) >= self.max_authed else []
            idle = [c for c in pool if not self._authed[c][2]]
            victim = min(idle, key=lambda c: self._authed[c][1], default=None)
            full = bool(pool) and victim is None
            if victim is not None:
                del self._authed[victim]
            if not full:
                self._authed[conn] = [src, time.monotonic(), False]
        if victim is not None or full:
            why = (f"{src} (caps {self.max_authed} authenticated connections, {self.max_authed_per_source} per "
                   "address: " + ("every one is busy, this one is refused)" if full else "the longest idle is cut)"))
            self.refuse("authed_capacity", why)
        if victim is not None:
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RDWR)
        return not full

    def busy(self, conn: socket.socket, on: bool) -> None:
        """An authenticated connection starts (``on``) or ends a request: a busy one is never cut."""
        with self._lock:
            e = self._authed.get(conn)
            if e is not None:
                e[1], e[2] = time.monotonic(), on

    def authed(self) -> int:
        with self._lock:
            return len(self._authed)

    def release(self, conn: socket.socket) -> None:
        self._forget(conn)
        with self._lock:
            self._authed.pop(conn, None)

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
