"""How every shardsync connection authenticates (control plane, tcp and nccl data planes): a mutual
challenge-response over the group's token, which never crosses the wire.

    server -> client   b"SS2" + Ns                      (Ns: 16 random bytes, new per connection)
    client -> server   Nc + HMAC-SHA256(token, b"c" + Ns + Nc)
    server -> client   b"K" + HMAC-SHA256(token, b"s" + Nc + Ns)     or b"E", then it closes

Every message has a fixed size, so nothing is allocated from a peer's word; the server reads the client's
answer by one wall-clock deadline (a peer that drips bytes is cut then). A sniffer on the network learns no
token and cannot replay an answer (``Ns`` is new each time); the client checks the server's proof too, so a
listener that does not hold the token cannot pose as a producer.

    ok = server_auth(conn, token, deadline_s=10, on_refused=count)   # then serve frames
    client_auth(sock, token, peer="producer 0")                       # AuthError when either side is wrong
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from typing import Any, Callable

from ..errors import AuthError

__all__ = ["MAX_TOKEN_BYTES", "server_auth", "client_auth"]

MAX_TOKEN_BYTES = 256
"""Longest token a peer may be configured with (a configuration check: the token itself is never sent)."""
BACKSTOP_S = 1.0
_HELLO = b"SS2"
_NONCE = 16
_MAC = 32
_OK, _ERR = b"K", b"E"


def _mac(token: str, side: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token.encode(), side + a + b, hashlib.sha256).digest()


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    from .tcp import recv_exact

    return recv_exact(sock, n, deadline=deadline)


def server_auth(conn: socket.socket, token: str, *, deadline_s: float,
                on_refused: Callable[[], Any] | None = None) -> bool:
    """True when the peer proved it holds ``token``. A refused peer is told ``E`` (``on_refused()`` runs first,
    so a peer that sees the refusal also sees it counted); the caller then closes. Raises ``socket.timeout``
    a second after ``deadline_s`` has passed (a backstop: the servers' admission watchdog cuts, and counts, the
    connection at ``deadline_s``), ``ConnectionError`` when the peer leaves."""
    deadline = time.monotonic() + deadline_s + BACKSTOP_S
    ns = os.urandom(_NONCE)
    conn.settimeout(deadline_s + BACKSTOP_S)
    conn.sendall(_HELLO + ns)
    answer = _recv(conn, _NONCE + _MAC, deadline)
    nc, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(token, b"c", ns, nc)):
        if on_refused is not None:
            on_refused()
        conn.sendall(_ERR)
        return False
    conn.sendall(_OK + _mac(token, b"s", nc, ns))
    return True


def client_auth(sock: socket.socket, token: str, *, peer: str, timeout_s: float | None = None) -> None:
    """Prove ``token`` to the server at the other end of ``sock`` and check its proof; :class:`AuthError` naming
    ``peer`` when the server refuses, is not a shardsync server, or does not hold the token. The whole exchange
    ends by ``timeout_s`` (None: the socket's own timeout, else 30 s) — a server that accepted but does not
    answer (stopped) fails the caller's connect within its bound."""
    if timeout_s is None:
        timeout_s = sock.gettimeout() or 30.0
    if len(token.encode()) > MAX_TOKEN_BYTES:
        raise AuthError(f"token is {len(token.encode())} bytes, at most {MAX_TOKEN_BYTES} are accepted")
    deadline, before = time.monotonic() + timeout_s, sock.gettimeout()
    try:
        _client(sock, token, peer, deadline)
    finally:
        sock.settimeout(before)


def _client(sock: socket.socket, token: str, peer: str, deadline: float) -> None:
    hello = _recv(sock, len(_HELLO) + _NONCE, deadline)
    if hello[:len(_HELLO)] != _HELLO:
        raise AuthError(f"{peer} does not speak shardsync's handshake (got {hello[:len(_HELLO)]!r})")
    ns, nc = hello[len(_HELLO):], os.urandom(_NONCE)
    sock.sendall(nc + _mac(token, b"c", ns, nc))
    if _recv(sock, 1, deadline) != _OK:
        raise AuthError(f"{peer} refused this connection's token")
    if not hmac.compare_digest(_recv(sock, _MAC, deadline), _mac(token, b"s", nc, ns)):
        raise AuthError(f"{peer} answered without holding the group's token: not a peer of this group")
