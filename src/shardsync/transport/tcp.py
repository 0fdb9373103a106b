"""TCP transport: the producer serves reads of its registered buffer from a socket thread.

Two-sided underneath, one-sided to the engine. Works between any processes (vLLM workers included);
binds to the configured interface (``advertise_host`` is what peers are told when binding 0.0.0.0),
checks a shared token on every connection before it reads a request (token length capped, a silent
peer times out), answers only reads inside the registered buffer, and closes idle connections::

    t = TcpTransport(host="127.0.0.1", token="s3cret")
    desc = t.register(buf)                       # producer: starts the serving thread
    t.connect(0, desc); t.read(0, 0, 1 << 20, out, timeout_s=10)   # consumer
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Any

import torch

from ..errors import TransportError
from ..security.admission import Admission, accept_loop
from ..security.handshake import client_auth, recv_exact, server_auth
from .base import Caps, check_range

_REQ = struct.Struct("!QQ")  # offset, nbytes
_OK, _ERR = b"K", b"E"
log = logging.getLogger("shardsync.transport.tcp")


def advertised(host: str, advertise_host: str | None) -> str:
    """The address peers are told: ``advertise_host``, else ``host`` — except a wildcard bind (0.0.0.0, ::, ""),
    which no peer can dial: then this machine's hostname address."""
    if advertise_host:
        return advertise_host
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()
    return host


def token_ok(conn: socket.socket, token: str, timeout_s: float, on_refused: Any = None) -> bool:
    """The server side of the data plane's handshake (``security/handshake.py``): True when the peer proved the token. The
    data plane runs plain (no frame MACs): chunk tags in MACed ``Ready`` frames cover its bytes end to end."""
    return server_auth(conn, token, deadline_s=timeout_s, on_refused=on_refused) is not None


def send_token(sock: socket.socket, token: str, extra: bytes = b"") -> bool:
    """The client side: prove the token (then send ``extra``); False when the server refused it."""
    from ..errors import AuthError

    try:
        client_auth(sock, token, peer="producer")
    except AuthError:
        return False
    if extra:
        sock.sendall(extra)
    return True


class TcpTransport:
    name = "tcp"
    caps = Caps(one_sided=False, gpu=False, can_abort=True, takes_token=True)

    def __init__(self, *, host: str = "127.0.0.1", token: str = "", port: int = 0, advertise_host: str | None = None,
                 idle_timeout_s: float = 3600.0, auth_timeout_s: float = 10.0):
        self.host, self.token, self.port = host, token, port
        self.advertise_host = advertise_host
        self.idle_timeout_s, self.auth_timeout_s = idle_timeout_s, auth_timeout_s
        self.refused = 0
        self.admission = Admission("tcp-serve", deadline_s=auth_timeout_s)
        self._server: socket.socket | None = None
        self._buf: torch.Tensor | None = None
        self._desc: dict[str, Any] = {}
        self._peers: dict[int, socket.socket] = {}
        self._peer_locks: dict[int, threading.Lock] = {}
        self._sizes: dict[int, int] = {}
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ producer
    def register(self, buf: torch.Tensor) -> dict[str, Any]:
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise TransportError("tcp transport registers contiguous uint8 CPU buffers only")
        if self._server is not None:  # serving already: the buffer replaces the one retired (same port)
            if self._buf is not None:
                raise TransportError("tcp transport registers one buffer at a time (retire it first)")
            self._buf = buf
            return {**self._desc, "nbytes": buf.numel()}
        self._buf = buf
        self._server = socket.create_server((self.host, self.port))
        self._server.settimeout(0.2)
        t = threading.Thread(target=accept_loop, args=(self._server, self._closed, self._serve, "shardsync-tcp-serve",
                                                       self.admission), name="shardsync-tcp-accept", daemon=True)
        t.start()
        self._threads.append(t)
        self._desc = {"host": advertised(self.host, self.advertise_host), "port": self._server.getsockname()[1],
                      "nbytes": buf.numel()}
        return dict(self._desc)

    def retire(self, desc: dict[str, Any]) -> bool:
        """Stop serving the registered buffer (reads of it are refused) until ``register`` names the next one."""
        if self._buf is None or desc.get("port") != self._desc["port"]:
            return False
        self._buf = None
        return True

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if not token_ok(conn, self.token, self.auth_timeout_s, self._refuse):
                    return
                self.admission.passed(conn)
                conn.settimeout(self.idle_timeout_s)
                while not self._closed.is_set():
                    off, n = _REQ.unpack(recv_exact(conn, _REQ.size))
                    buf = self._buf  # read per request: a retired buffer is replaced in place
                    mv = memoryview(buf.numpy()) if buf is not None else memoryview(b"")
                    if off + n > len(mv):
                        conn.sendall(_ERR)
                        continue
                    conn.sendall(_OK)
                    conn.sendall(mv[off: off + n])
            except (ConnectionError, OSError):
                return  # peer gone, idle, or closing
            except Exception:  # never die silently
                log.exception("tcp transport: serving thread failed")
            finally:
                self.admission.release(conn)

    def _refuse(self) -> None:
        self.refused += 1
        self.admission.refuse("token")

    # ------------------------------------------------------------ consumer
    def connect(self, producer: int, desc: dict[str, Any], *, timeout_s: float = 30.0) -> None:
        try:
            s = socket.create_connection((desc["host"], int(desc["port"])), timeout=timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not send_token(s, self.token):
                raise TransportError(f"tcp: producer {producer} at {desc['host']}:{desc['port']} rejected the token")
        except (OSError, ConnectionError) as e:
            raise TransportError(f"tcp: cannot connect to producer {producer} at {desc.get('host')}:"
                                 f"{desc.get('port')}: {e}") from None
        self._drop(producer)  # a restarted producer: its predecessor's socket is stale
        self._peers[producer] = s
        self._peer_locks[producer] = threading.Lock()
        self._sizes[producer] = int(desc["nbytes"])

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None:
        s = self._peers.get(producer)
        if s is None:
            raise TransportError(f"tcp: producer {producer} is not connected")
        check_range(self._sizes[producer], offset, nbytes, into, f"producer {producer}")
        if nbytes == 0:
            return
        with self._peer_locks[producer]:
            deadline = time.monotonic() + timeout_s  # the whole read: a producer dripping bytes cannot stretch it
            try:
                s.settimeout(timeout_s)
                s.sendall(_REQ.pack(offset, nbytes))
                if recv_exact(s, 1, deadline=deadline) != _OK:
                    self._drop(producer)
                    raise TransportError(f"tcp: producer {producer} refused read [{offset}, {offset + nbytes})")
                recv_exact(s, nbytes, memoryview(into[:nbytes].numpy()), deadline=deadline)
            except socket.timeout:
                self._drop(producer)  # the rest of the reply may still arrive: the stream is out of step
                raise TransportError(f"tcp: read [{offset}, {offset + nbytes}) from producer {producer} did not "
                                     f"complete within {timeout_s} s") from None
            except (OSError, ConnectionError) as e:
                self._drop(producer)
                raise TransportError(f"tcp: read [{offset}, {offset + nbytes}) from producer {producer} failed: "
                                     f"{e}") from None

    def _drop(self, producer: int) -> None:
        s = self._peers.pop(producer, None)
        if s is not None:
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        self.admission.close()
        if self._server is not None:
            self._server.close()
        for s in self._peers.values():
            try:
                s.close()
            except OSError:
                pass
        self._peers.clear()
