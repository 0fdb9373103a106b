"""How every shardsync connection authenticates (control plane, tcp and nccl data planes): a mutual
challenge-response over the group's token, which never crosses the wire.

    server -> client   HELLO + Ns                       (Ns: 16 random bytes, new per connection)
    client -> server   Nc + HMAC-SHA256(token, b"c" + M + Ns + Nc)
    server -> client   b"K" + HMAC-SHA256(token, b"s" + M + Nc + Ns)     or b"E", then it closes

``HELLO`` is ``b"SS2"`` (plain: ``M`` is empty) or ``b"SM2"`` (MAC mode, ``M = b"M"``: every frame after the
handshake carries a tag, ``framemac.py``; a control server of a group run with ``ProducerConfig.mac``). Clients
follow the server's mode; a client that requires MACs (``require_mac``) refuses a plain server with
:class:`AuthError` before it answers. The mode is inside both proofs, so a man in the middle who rewrites the
hello (a downgrade, or an upgrade) makes the handshake fail. The tcp and nccl data planes stay plain: the bytes
they move are covered end to end by the chunk tags that travel in MACed ``Ready`` frames (``security/chunkmac.py``).

Every message has a fixed size, so nothing is allocated from a peer's word; the server reads the client's
answer by one wall-clock deadline (a peer that drips bytes is cut then). A sniffer on the network learns no
token and cannot replay an answer (``Ns`` is new each time); the client checks the server's proof too, so a
listener that does not hold the token cannot pose as a producer.

    ok = server_auth(conn, token, deadline_s=10, on_refused=count, mac=True)   # None when refused
    ok.frames                                         # FrameMac (MAC mode) or None: what tags this connection's frames
    client_auth(sock, token, peer="producer 0", require_mac=True)   # AuthError when either side is wrong
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import time
from typing import Any, Callable, NamedTuple

from ..errors import AuthError
from .admission import RateLimited
from .framemac import FrameMac

log = logging.getLogger("shardsync.handshake")

__all__ = ["MAX_TOKEN_BYTES", "Authenticated", "server_auth", "client_auth", "peer_name"]

MAX_TOKEN_BYTES = 256
"""Longest token a peer may be configured with (a configuration check: the token itself is never sent)."""
BACKSTOP_S = 1.0
_HELLO, _HELLO_MAC = b"SS2", b"SM2"
_NONCE = 16
_MAC = 32
_OK, _ERR = b"K", b"E"


class Authenticated(NamedTuple):
    """A connection that passed the handshake (truthy)."""

    frames: FrameMac | None
    """This end's per-frame MAC state (the server ran in MAC mode), else None: frames travel untagged."""


def _mac(token: str, side: bytes, a: bytes, b: bytes, *, mode: bool = False) -> bytes:
    return hmac.new(token.encode(), side + (b"M" if mode else b"") + a + b, hashlib.sha256).digest()


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    return recv_exact(sock, n, deadline=deadline)


DOWNGRADES = [0]
"""Handshakes refused for an answer in the other mode (a stripped or rewritten MAC negotiation)."""
_downgrade_log = RateLimited(logger=log)  # peers are not trusted: at most one log a second


def peer_name(conn: socket.socket) -> str:
    """``host:port`` of a connection's peer (what a Unix socket has, else "a peer")."""
    try:
        name = conn.getpeername()
    except OSError:
        return "a peer"
    return "%s:%s" % name[:2] if isinstance(name, tuple) and len(name) >= 2 else (str(name) or "a local peer")


def server_auth(conn: socket.socket, token: str, *, deadline_s: float,
                on_refused: Callable[[], Any] | None = None, mac: bool = False) -> Authenticated | None:
    """An :class:`Authenticated` when the peer proved it holds ``token`` (with ``mac``: in MAC mode, ``frames`` set),
    None when refused. A refused peer is told ``E`` (``on_refused()`` runs first,
    so a peer that sees the refusal also sees it counted); the caller then closes. Raises ``socket.timeout``
    a second after ``deadline_s`` has passed (a backstop: the servers' admission watchdog cuts, and counts, the
    connection at ``deadline_s``), ``ConnectionError`` when the peer leaves."""
    deadline = time.monotonic() + deadline_s + BACKSTOP_S
    ns = os.urandom(_NONCE)
    conn.settimeout(deadline_s + BACKSTOP_S)
    conn.sendall((_HELLO_MAC if mac else _HELLO) + ns)
    answer = _recv(conn, _NONCE + _MAC, deadline)
    nc, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(token, b"c", ns, nc, mode=mac)):
        if hmac.compare_digest(proof, _mac(token, b"c", ns, nc, mode=not mac)):  # the token, but the other mode:
            DOWNGRADES[0] += 1
            _downgrade_log(logging.WARNING, "refused %s: it holds the token but answered a %s handshake: the MAC "
                           "negotiation was stripped or rewritten on the way (or a peer forged it); %d so far",
                           peer_name(conn), "plain" if mac else "MAC-mode", DOWNGRADES[0])
        elif on_refused is not None:
            on_refused()
        conn.sendall(_ERR)
        return None
    conn.sendall(_OK + _mac(token, b"s", nc, ns, mode=mac))
    return Authenticated(FrameMac(token, ns, nc, server=True) if mac else None)


def client_auth(sock: socket.socket, token: str, *, peer: str, timeout_s: float | None = None,
                require_mac: bool = False) -> Authenticated:
    """Prove ``token`` to the server at the other end of ``sock`` and check its proof; :class:`AuthError` naming
    ``peer`` when the server refuses, is not a shardsync server, or does not hold the token — or, with
    ``require_mac``, does not offer per-frame MACs. The whole exchange
    ends by ``timeout_s`` (None: the socket's own timeout, else 30 s) — a server that accepted but does not
    answer (stopped) fails the caller's connect within its bound. The result's ``frames`` is set when the server
    runs in MAC mode (the client follows it)."""
    if timeout_s is None:
        timeout_s = sock.gettimeout() or 30.0
    if len(token.encode()) > MAX_TOKEN_BYTES:
        raise AuthError(f"token is {len(token.encode())} bytes, at most {MAX_TOKEN_BYTES} are accepted")
    deadline, before = time.monotonic() + timeout_s, sock.gettimeout()
    try:
        return _client(sock, token, peer, deadline, require_mac)
    finally:
        sock.settimeout(before)


def _client(sock: socket.socket, token: str, peer: str, deadline: float, require_mac: bool) -> Authenticated:
    hello = _recv(sock, len(_HELLO) + _NONCE, deadline)
    magic = hello[:len(_HELLO)]
    if magic not in (_HELLO, _HELLO_MAC):
        raise AuthError(f"{peer} does not speak shardsync's handshake (got {magic!r})")
    mode = magic == _HELLO_MAC
    if require_mac and not mode:
        raise AuthError(f"{peer} does not MAC its control frames, and this side requires it (require_mac): run the "
                        "producers with mac=True (ProducerConfig, ShardsyncTrainerInitInfo, LocalCluster) or drop "
                        "require_mac")
    ns, nc = hello[len(_HELLO):], os.urandom(_NONCE)
    sock.sendall(nc + _mac(token, b"c", ns, nc, mode=mode))
    if _recv(sock, 1, deadline) != _OK:
        raise AuthError(f"{peer} refused this connection's token")
    if not hmac.compare_digest(_recv(sock, _MAC, deadline), _mac(token, b"s", nc, ns, mode=mode)):
        raise AuthError(f"{peer} answered without holding the group's token: not a peer of this group")
    return Authenticated(FrameMac(token, ns, nc, server=False) if mode else None)


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None, *,
               deadline: float | None = None) -> bytes | None:
    """Read exactly n bytes (into ``into`` when given). Raises ConnectionError on EOF; with ``deadline`` (a
    ``time.monotonic()`` value) ``socket.timeout`` once it passes, however the bytes trickle in."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{got} of {n} bytes by the deadline")
            sock.settimeout(left)
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return None if into is not None else bytes(buf)
