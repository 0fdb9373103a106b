"""Per-frame MACs of one authenticated control connection (``ProducerConfig.mac``): what the handshake's MAC mode
(``handshake.py``) hands to both ends.

The key is derived from the group's token and BOTH handshake nonces, so it is new for every connection; each frame
carries a 16-byte tag::

    key = HMAC-SHA256(token, b"shardsync frame mac v1" + Ns + Nc)
    tag = HMAC-SHA256(key, direction + seq + len(payload) + payload)[:16]

``direction`` is ``b"c"`` (client -> server) or ``b"s"``; ``seq`` (8 bytes, big-endian) counts the frames sent in
that direction on this connection, from 0. Each end keeps both counters, so a frame replayed (on this connection or
another one: another key), reordered, reflected back to its sender or injected fails its check, and the receiver
closes the connection. Only the payload's integrity and origin are protected: nothing is encrypted.

    fm = FrameMac(token, ns, nc, server=False)
    tag = fm.seal(payload)            # what this end sends after the payload
    fm.check(payload, tag)            # a received frame; FrameMacError (the caller closes) when it is not genuine
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from ..errors import FrameMacError

__all__ = ["TAG_BYTES", "FrameMac"]

TAG_BYTES = 16
"""Bytes of every frame's tag (HMAC-SHA256, truncated)."""
_LABEL = b"shardsync frame mac v1"
_HEAD = struct.Struct("!cQI")  # direction, sequence number, payload length


class FrameMac:
    """One end's MAC state for one connection: the key, and a sequence counter per direction."""

    def __init__(self, token: str, ns: bytes, nc: bytes, *, server: bool):
        self._key = hmac.new(token.encode(), _LABEL + ns + nc, hashlib.sha256).digest()
        self._out, self._in = (b"s", b"c") if server else (b"c", b"s")
        self.sent = 0
        """Frames this end has tagged on this connection."""
        self.received = 0
        """Frames this end has accepted on this connection."""

    def __repr__(self) -> str:  # never the key
        return f"FrameMac(sent={self.sent}, received={self.received})"

    def _tag(self, direction: bytes, seq: int, payload: bytes | memoryview) -> bytes:
        h = hmac.new(self._key, _HEAD.pack(direction, seq, len(payload)), hashlib.sha256)
        h.update(payload)
        return h.digest()[:TAG_BYTES]

    def seal(self, payload: bytes | memoryview) -> bytes:
        """The tag of the next frame this end sends (callers serialise sends on one connection)."""
        tag = self._tag(self._out, self.sent, payload)
        self.sent += 1
        return tag

    def check(self, payload: bytes | memoryview, tag: bytes) -> None:
        """Accept the next frame from the peer, or raise :class:`FrameMacError` (the connection must then be
        closed: the two ends' counters no longer agree)."""
        if not hmac.compare_digest(tag, self._tag(self._in, self.received, payload)):
            raise FrameMacError(f"control frame {self.received} from the peer ({len(payload)} bytes) failed its MAC: "
                                "tampered with, replayed, reordered or injected on the wire")
        self.received += 1
