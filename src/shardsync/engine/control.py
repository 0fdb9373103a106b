"""Control plane: small request/response messages over TCP, msgpack-encoded (never pickle).

Every request carries the shared token, checked before it is handled; servers bind to the
interface they are given. A request that gets no answer within its timeout raises TransportError
naming the peer and the request::

    server = ControlServer("127.0.0.1", 0, token, handler)     # handler(msg) -> reply message
    client = ControlClient(server.address, token, peer="producer 0")
    reply = client.call(Released(consumer="r0/tp1", version=3, group="model.layers.7"), timeout_s=30)
"""

from __future__ import annotations

import hmac
import socket
import struct
import threading
from typing import Any, Callable, Union

import msgspec

from ..errors import ShardsyncError, TransportError
from ..transport.tcp import recv_exact

__all__ = ["ControlServer", "ControlClient", "Msg"]


class _M(msgspec.Struct, tag=True, kw_only=True):
    token: str = ""


class Ack(_M):
    pass


class Fail(_M):
    error: str
    kind: str = "ShardsyncError"


class Join(_M):  # producer -> coordinator
    rank: int
    address: list[Any]
    held: list[str] | None
    meta_digest: str


class Hello(_M):  # consumer -> coordinator
    consumer: str


class TransferMeta(_M):
    metadata: list[dict[str, Any]]
    held: list[list[str] | None]
    max_chunk_bytes: int


class RegisterPlan(_M):  # consumer -> coordinator
    consumer: str
    plan: bytes


class Routes(_M):
    routes: dict[str, list[int]]
    producers: list[dict[str, Any]]
    """[{"rank", "address", "desc"}] for every producer."""


class GetAssignments(_M):  # producer -> coordinator
    rank: int


class Assignments(_M):
    held: list[list[str] | None]
    """Names each producer holds (None = all), by producer rank."""
    plans: list[bytes]
    routes: dict[str, dict[str, list[int]]]
    consumers: dict[str, list[str]]
    """plan digest -> consumer ids using it."""


class ProducerReady(_M):  # producer -> coordinator, after registering its ring
    rank: int
    desc: dict[str, Any]


class WaitReady(_M):  # consumer -> producer
    consumer: str
    version: int
    group: str


class Ready(_M):
    version: int
    group: str
    chunks: list[list[int]]
    """[[chunk index, offset in the producer's registered buffer, nbytes], ...] for this consumer's plan."""


class Released(_M):  # consumer -> producer
    consumer: str
    version: int
    group: str


class Goodbye(_M):  # consumer -> producer: leaving (its releases are no longer awaited)
    consumer: str


Msg = Union[Ack, Fail, Join, Hello, TransferMeta, RegisterPlan, Routes, GetAssignments, Assignments, ProducerReady,
            WaitReady, Ready, Released, Goodbye]
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Msg)
_LEN = struct.Struct("!I")


def _send(sock: socket.socket, msg: Msg) -> None:
    data = _enc.encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket) -> Msg:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    return _dec.decode(recv_exact(sock, n))


class ControlServer:
    """Threaded server: one thread per connection, ``handler(msg)`` may block (bounded by its own timeouts)."""

    def __init__(self, host: str, port: int, token: str, handler: Callable[[Msg], Msg]):
        self.token, self.handler = token, handler
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self.address = [host, self._sock.getsockname()[1]]
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="shardsync-control", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(None)
            while not self._closed.is_set():
                try:
                    msg = _recv(conn)
                except (ConnectionError, OSError, msgspec.DecodeError):
                    return
                if not hmac.compare_digest(msg.token, self.token):
                    reply: Msg = Fail(error="bad token", kind="TransportError")
                else:
                    try:
                        reply = self.handler(msg)
                    except ShardsyncError as e:
                        reply = Fail(error=str(e), kind=type(e).__name__)
                    except Exception as e:  # never let a handler bug kill the connection silently
                        reply = Fail(error=f"{type(e).__name__}: {e}", kind="ShardsyncError")
                try:
                    _send(conn, reply)
                except OSError:
                    return

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class ControlClient:
    """One connection to one server; ``call`` is serialised per client."""

    def __init__(self, address: list[Any], token: str, *, peer: str, connect_timeout_s: float = 30.0):
        self.token, self.peer = token, peer
        try:
            self._sock = socket.create_connection((address[0], int(address[1])), timeout=connect_timeout_s)
        except OSError as e:
            raise TransportError(f"cannot reach {peer} at {address[0]}:{address[1]}: {e}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        self._broken = ""

    def _break(self, why: str) -> None:
        self._broken = why
        try:
            self._sock.close()
        except OSError:
            pass

    def call(self, msg: Msg, *, timeout_s: float) -> Msg:
        msg.token = self.token
        with self._lock:
            if self._broken:  # a late reply may still be in flight: never read it as another call's answer
                raise TransportError(f"connection to {self.peer} is broken after an earlier failure ({self._broken})")
            try:
                self._sock.settimeout(timeout_s)
                _send(self._sock, msg)
                reply = _recv(self._sock)
            except socket.timeout:
                self._break(f"{type(msg).__name__} timed out")
                raise TransportError(f"{self.peer} did not answer {type(msg).__name__} within {timeout_s} s") from None
            except (OSError, ConnectionError, msgspec.DecodeError) as e:
                self._break(f"{type(msg).__name__}: {e}")
                raise TransportError(f"{self.peer} is unreachable ({type(msg).__name__}): {e}") from None
        if isinstance(reply, Fail):
            from .. import errors

            cls = getattr(errors, reply.kind, ShardsyncError)
            try:
                err = cls(f"{self.peer}: {reply.error}")
            except TypeError:  # errors with keyword-only constructors travel as their base class
                err = ShardsyncError(f"{self.peer}: {reply.kind}: {reply.error}")
            raise err
        return reply

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
