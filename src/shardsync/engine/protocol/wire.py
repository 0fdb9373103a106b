"""The control plane's framing: an authenticated handshake, then length-prefixed msgpack frames.

Nothing is allocated or decoded before it is checked (engine rule 5):

1. A connection opens with the mutual challenge-response of ``security/handshake.py`` (HMAC-SHA256 over
   fresh nonces: the token never crosses the wire). No frame is read on a connection that has not
   authenticated.
2. Each frame is ``!I`` length + payload; a length over the receiver's ``max_frame_bytes`` closes the
   connection (:class:`FrameTooLarge`) before any buffer is allocated. On a connection in MAC mode (the server's
   group runs with ``ProducerConfig.mac``) a 16-byte tag follows each payload (``security/framemac.py``: a key
   fresh per connection, a sequence number per direction); a wrong one is :class:`FrameMacError` and the
   connection is closed.
3. Payloads are msgspec-msgpack structs of a closed union (never pickle).

    frames = handshake_client(sock, token, "producer 0")   # AuthError when refused; a FrameMac in MAC mode, or None
    send_frame(sock, b"...", frames);  payload = recv_frame(sock, max_frame_bytes=1 << 20, mac=frames)
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from ...errors import TransportError
from ...config import DEFAULT_MAX_FRAME
from ...security.framemac import TAG_BYTES, FrameMac
from ...security.handshake import MAX_TOKEN_BYTES, Authenticated, client_auth, recv_exact, server_auth

__all__ = ["MAX_TOKEN_BYTES", "DEFAULT_MAX_FRAME", "FrameTooLarge", "handshake_client", "handshake_server",
           "send_frame", "recv_frame", "chunk_checksum", "parse_address"]

"""Largest control frame accepted (a plan of a trillion-parameter model is tens of MB)."""
_LEN = struct.Struct("!I")


class FrameTooLarge(TransportError):
    """A peer announced a frame larger than this side accepts."""


def handshake_client(sock: socket.socket, token: str, peer: str, *, require_mac: bool = False) -> FrameMac | None:
    """Authenticate this end of a control connection (``security/handshake.py``): AuthError when refused (or, with
    ``require_mac``, when the server does not MAC its frames); ``ConnectionError``/``socket.timeout`` (retried by
    the callers) when the connection ends first. Returns the connection's frame MAC state (None: plain)."""
    return client_auth(sock, token, peer=peer, require_mac=require_mac).frames


def handshake_server(sock: socket.socket, token: str, *, deadline_s: float = 10.0, on_refused=None,
                     mac: bool = False) -> Authenticated | None:
    """An ``Authenticated`` (its ``frames``: the MAC state in MAC mode) when the peer proved it holds ``token``;
    None when refused (the peer is told so; the caller then closes)."""
    return server_auth(sock, token, deadline_s=deadline_s, on_refused=on_refused, mac=mac)


def send_frame(sock: socket.socket, payload: bytes, mac: FrameMac | None = None) -> None:
    head = _LEN.pack(len(payload))
    sock.sendall(head + payload if mac is None else head + payload + mac.seal(payload))


def recv_frame(sock: socket.socket, *, max_frame_bytes: int, mac: FrameMac | None = None) -> bytes:
    """The next frame's payload; with ``mac``, only once its tag checked (:class:`FrameMacError` otherwise)."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > max_frame_bytes:
        raise FrameTooLarge(f"peer announced a {n}-byte frame, the limit is {max_frame_bytes}")
    payload = recv_exact(sock, n)
    if mac is not None:
        mac.check(payload, recv_exact(sock, TAG_BYTES))
    return payload


def chunk_checksum(data) -> int:
    """xxh3-64 of a contiguous uint8 tensor: what a producer sends with a chunk and a consumer recomputes (a GPU
    chunk is copied to the host for it: checksums cost a device-to-host copy of every byte)."""
    import xxhash

    if data.device.type != "cpu":
        data = data.cpu()
    return xxhash.xxh3_64_intdigest(memoryview(data.numpy()))


def parse_address(addr: Any) -> list[Any]:
    """``"host:port"``, ``"[v6]:port"``, ``(host, port)`` or ``[host, port]`` -> ``[host, port]``; a clear
    ``ValueError`` for anything else."""
    if isinstance(addr, str):
        host, sep, port = addr.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address {addr!r} is not 'host:port'")
        return [host, int(port)]
    if isinstance(addr, (list, tuple)) and len(addr) == 2 and isinstance(addr[0], str) and str(addr[1]).isdigit():
        return [addr[0], int(addr[1])]
    raise ValueError(f"address {addr!r} is neither 'host:port' nor (host, port)")
