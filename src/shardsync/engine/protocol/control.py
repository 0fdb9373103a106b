"""Control plane: the token-checked request/response service and its client, over TCP.

The messages (msgspec structs, msgpack-encoded, never pickle) are ``messages.py``; this module moves them.

A connection authenticates once with the shared token before any frame is read (``wire.py``);
frames are size-limited before allocation; a server started with ``mac=True`` (a group run with
``ProducerConfig.mac``) has every frame of every connection tagged both ways, and a client follows it (one with
``require_mac`` refuses a server that does not); a frame with a wrong tag closes its connection (counted in
``refused["mac"]`` and logged by the server; :class:`FrameMacError` at the client); consumers additionally carry
the per-consumer session credential the coordinator issued at ``Hello`` on every message that acts for them
(release, abandon, goodbye, renew). Servers bind to the interface they are given, time out idle and
half-open connections, and log (never swallow silently) anything that ends a serving thread.
A connection refused for a wrong token is logged at once, naming the peer — once per source address (a bounded
table; repeats from that address are counted, not logged; past the table, refusals are logged at most once a
second) — and ``refusals()`` names the newest few (a coordinator's init wait says them while its quorum is missing).
A request that gets no answer within its timeout raises TransportError naming the peer and the
request; a client whose connection broke reconnects on its next call::

    server = ControlServer("127.0.0.1", 0, token, handler)     # handler(msg) -> reply message
    client = ControlClient(server.address, token, peer="producer 0")
    reply = client.call(m.Released(consumer="r0/tp1", session=s, version=3, group="model.layers.7"), timeout_s=30)
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections import defaultdict, deque
from typing import Any, Callable

import msgspec

from ...errors import AuthError, FrameMacError, ShardsyncError, TransportError
from ...security.admission import MAX_AUTHED, MAX_AUTHED_PER_SOURCE, MAX_PENDING, MAX_PER_SOURCE, Admission, accept_loop
from ...security.handshake import peer_name
from ...security.framemac import FrameMac
from ...transport.tcp import advertised
from .messages import Fail, Msg, clip, decode, encode
from .wire import (DEFAULT_MAX_FRAME, FrameTooLarge, handshake_client, handshake_server, parse_address, recv_frame,
                   send_frame)

__all__ = ["ControlServer", "ControlClient"]
log = logging.getLogger("shardsync.control")

REFUSED_HOSTS = 64
"""Source addresses whose first wrong-token refusal a server logs (peers are untrusted: the table is bounded)."""
REFUSED_KEPT = 4
"""Newest refused connections (address:port) a server keeps to name in ``refusals()``."""


class ControlServer:
    """Threaded server: one thread per connection, ``handler(msg)`` may block (bounded by its own timeouts).
    It serves each producer (and the coordinator on rank 0) and verl's rendezvous (``integrations/verl``).

    ``idle_timeout_s`` closes a connection that sends nothing for that long (clients reconnect);
    an unauthenticated connection gets ``auth_timeout_s``. ``inflight()`` counts requests being handled
    or answered, so an owner can let its last replies go out before it closes."""

    def __init__(self, host: str, port: int, token: str, handler: Callable[[Msg], Msg], *,
                 advertise_host: str | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME,
                 idle_timeout_s: float = 600.0, auth_timeout_s: float = 10.0, name: str = "control",
                 max_pending: int = MAX_PENDING, max_per_source: int = MAX_PER_SOURCE, mac: bool = False,
                 max_authed: int = MAX_AUTHED, max_authed_per_source: int = MAX_AUTHED_PER_SOURCE):
        self.token, self.handler, self.name, self.mac = token, handler, name, mac
        self.max_frame_bytes, self.idle_timeout_s, self.auth_timeout_s = max_frame_bytes, idle_timeout_s, auth_timeout_s
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self.address = [advertised(host, advertise_host), self._sock.getsockname()[1]]
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._inflight: dict[str, int] = defaultdict(int)
        self._answered = threading.Condition(self._lock)  # notified whenever a request's answer has gone out
        self.refused: dict[str, int] = {"token": 0, "frame": 0, "decode": 0, "mac": 0}
        self._refused_hosts: set[str] = set()  # logged once each (at most REFUSED_HOSTS)
        self._refused_from: deque[str] = deque(maxlen=REFUSED_KEPT)
        self.handler_errors = 0
        self.admission = Admission(name, deadline_s=auth_timeout_s, max_pending=max_pending,
                                   max_per_source=max_per_source, max_authed=max_authed,
                                   max_authed_per_source=max_authed_per_source)
        """Connections: unauthenticated ones capped per server and per source address with one handshake deadline;
        authenticated ones capped too (the longest idle cut), and idle ones closed after ``idle_timeout_s``."""
        self._thread = threading.Thread(target=accept_loop, args=(self._sock, self._closed, self._serve_tracked,
                                                                  f"shardsync-{name}-conn", self.admission),
                                        name=f"shardsync-{name}-accept", daemon=True)
        self._thread.start()

    def inflight(self, *kinds: str) -> int:
        """Requests (of these message kinds, or of any) being handled or answered right now."""
        with self._lock:
            return self._count(kinds)

    def _count(self, kinds: tuple[str, ...]) -> int:
        return sum(n for k, n in self._inflight.items() if not kinds or k in kinds)

    def wait_answered(self, *kinds: str, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no request of these kinds (or of any) is being handled or answered;
        False if some still are. Woken by each answer sent, not by polling."""
        with self._answered:
            return self._answered.wait_for(lambda: self._count(kinds) == 0, timeout=timeout_s)

    def _serve_tracked(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        self._serve(conn)

    def _refuse(self, conn: socket.socket) -> None:
        peer = peer_name(conn)
        host = peer.rsplit(":", 1)[0]
        with self._lock:
            self.refused["token"] += 1
            self._refused_from.append(peer)
            first = host not in self._refused_hosts and len(self._refused_hosts) < REFUSED_HOSTS
            if first:
                self._refused_hosts.add(host)
            known = host in self._refused_hosts
        if first:
            self.admission.refused["token"] += 1
            log.warning("%s: refused a connection from %s: wrong token (that peer does not hold this group's token: "
                        "give it the producers' token; further refusals from %s are counted, not logged)",
                        self.name, peer, host)
        elif known:
            self.admission.refused["token"] += 1
        else:  # past the table: counted and logged at most once a second
            self.admission.refuse("token", f"{peer} (wrong token)")

    def refusals(self) -> str:
        """The connections refused for a wrong token, e.g. "2 connections with a wrong token from 127.0.0.1:51432,
        127.0.0.1:51436" (the newest ``REFUSED_KEPT``), or "" if none."""
        with self._lock:
            n, newest = self.refused["token"], list(self._refused_from)
        if not n:
            return ""
        more = ", ..." if n > len(newest) else ""
        return f"{n} connection{'s' if n != 1 else ''} with a wrong token from {', '.join(newest)}{more}"

    def _serve(self, conn: socket.socket) -> None:
        try:
            auth = handshake_server(conn, self.token, deadline_s=self.auth_timeout_s,
                                    on_refused=lambda: self._refuse(conn), mac=self.mac)
            if auth is None:
                return
            if not self.admission.passed(conn):  # over the authenticated caps with every one busy
                return
            conn.settimeout(self.idle_timeout_s)
            while not self._closed.is_set():
                try:
                    msg = decode(recv_frame(conn, max_frame_bytes=self.max_frame_bytes, mac=auth.frames))
                except FrameMacError:  # counted and logged (rate-limited) like a refused handshake
                    self.refused["mac"] += 1
                    self.admission.refuse("mac", f"a frame from {peer_name(conn)} (its MAC is wrong: connection closed)")
                    return
                except FrameTooLarge as e:
                    self.refused["frame"] += 1
                    log.warning("%s: %s; connection closed", self.name, e)
                    return
                except msgspec.DecodeError as e:
                    self.refused["decode"] += 1
                    log.warning("%s: undecodable frame (%s); connection closed", self.name, e)
                    return
                kind = type(msg).__name__
                with self._lock:
                    self._inflight[kind] += 1
                self.admission.busy(conn, True)
                try:
                    reply = self._handle(msg)
                    send_frame(conn, encode(reply), auth.frames)
                finally:
                    self.admission.busy(conn, False)
                    with self._lock:
                        self._inflight[kind] -= 1
                        self._answered.notify_all()
        except (ConnectionError, socket.timeout, OSError):
            return  # peer gone, idle, or server closing: nothing of ours was lost
        except Exception:  # a bug in this server: say so, never die silently
            log.exception("%s: serving thread failed", self.name)
        finally:
            self.admission.release(conn)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, msg: Msg) -> Msg:
        try:
            return self.handler(msg)
        except ShardsyncError as e:
            return Fail(error=clip(str(e)), kind=type(e).__name__)
        except Exception as e:  # a handler bug: the caller gets it, and the log has the traceback
            self.handler_errors += 1
            log.exception("%s: handler failed on %s", self.name, type(msg).__name__)
            return Fail(error=clip(f"{type(e).__name__}: {e}"), kind="ShardsyncError")

    def close(self) -> None:
        self._closed.set()
        self.admission.close()
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection was closed by its server (readable at once with nothing to read: EOF); a call
    then reconnects first instead of failing."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        sock.setblocking(False)
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        finally:
            sock.setblocking(True)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class ControlClient:
    """One connection to one server; ``call`` is serialised per client. A broken connection is never
    reused (a late reply could be read as another call's answer): the next call reconnects."""

    def __init__(self, address: list[Any], token: str, *, peer: str, connect_timeout_s: float = 30.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME, require_mac: bool = False):
        self.address, self.token, self.peer = parse_address(address), token, peer
        self.connect_timeout_s, self.max_frame_bytes = connect_timeout_s, max_frame_bytes
        self.require_mac = require_mac
        """Refuse (AuthError) a server that does not MAC its frames."""
        self.macs = False
        """The server MACs its frames (its group runs with ``ProducerConfig.mac``): learnt at each handshake."""
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._frames: FrameMac | None = None
        with self._lock:
            self._connect()

    def _connect(self, timeout_s: float | None = None) -> socket.socket:
        timeout_s = self.connect_timeout_s if timeout_s is None else min(timeout_s, self.connect_timeout_s)
        try:
            s = socket.create_connection((self.address[0], int(self.address[1])), timeout=timeout_s)
        except OSError as e:
            raise TransportError(f"cannot reach {self.peer} at {self.address[0]}:{self.address[1]}: {e}") from None
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            frames = handshake_client(s, self.token, self.peer, require_mac=self.require_mac)
        except AuthError:
            s.close()
            raise
        except (OSError, ConnectionError) as e:
            s.close()
            raise TransportError(f"{self.peer} closed the connection during the handshake: {e}") from None
        self._sock, self._frames, self.macs = s, frames, frames is not None
        return s

    def _break(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None

    def call(self, msg: Msg, *, timeout_s: float) -> Msg:
        with self._lock:
            if self._sock is not None and _closed_by_peer(self._sock):  # cut while idle (a server's idle timeout or
                self._break()                                         # its connection caps): nothing was sent
            sock = self._sock or self._connect(timeout_s)  # a reconnect is bounded by the call's own timeout
            try:
                sock.settimeout(timeout_s)
                send_frame(sock, encode(msg), self._frames)
                reply = decode(recv_frame(sock, max_frame_bytes=self.max_frame_bytes, mac=self._frames))
            except FrameMacError as e:  # tampered with on the wire: this connection is never read again
                self._break()
                raise FrameMacError(f"{self.peer} ({type(msg).__name__}): {e}; connection closed") from None
            except socket.timeout:
                self._break()
                raise TransportError(f"{self.peer} did not answer {type(msg).__name__} within {timeout_s} s") from None
            except (OSError, ConnectionError, msgspec.DecodeError) as e:
                self._break()
                raise TransportError(f"{self.peer} is unreachable ({type(msg).__name__}): {e}") from None
            except FrameTooLarge as e:  # the stream is out of step now: never read from this socket again
                self._break()
                raise TransportError(f"{self.peer} answered {type(msg).__name__} with {e}") from None
        if isinstance(reply, Fail):
            from ... import errors

            cls = getattr(errors, reply.kind, ShardsyncError)
            if not (isinstance(cls, type) and issubclass(cls, ShardsyncError)):
                cls = ShardsyncError
            try:
                err = cls(f"{self.peer}: {reply.error}")
            except TypeError:  # errors with keyword-only constructors travel as their base class
                err = ShardsyncError(f"{self.peer}: {reply.kind}: {reply.error}")
            raise err
        return reply

    def close(self) -> None:
        s = self._sock  # no lock: a call blocked in recv must be interrupted, not waited for
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
