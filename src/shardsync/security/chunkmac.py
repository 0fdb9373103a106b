"""Keyed chunk tags (``ProducerConfig.mac``): a producer tags every chunk it packs, a consumer checks each chunk it
pulls, so bytes changed anywhere between the two — on any transport, in any buffer — or replayed from another
version, group, chunk or producer are refused (:class:`ChunkMacError`). They supersede the unkeyed xxh3 checksums
(``wire.chunk_checksum``), which catch accidents but not an attacker.

    key = HMAC-SHA256(token, b"shardsync chunk mac v1")                 # once per process; never sent
    tag = BLAKE2b-128(key=key, header + chunk bytes)
    header = !IqIQH (producer rank, version, chunk index, nbytes, len(group)) + group (UTF-8)

Tags travel in ``Ready`` (``messages.py``: exactly 16 bytes each, one per chunk), whose frames are MACed on the
control connection (``security/framemac.py``): the tag a consumer checks against is the one its producer computed.

    key = chunk_key(token)
    tag = chunk_tag(key, producer=0, version=3, group="model.layers.7", chunk=2, data=region)
    check_chunk(key, tag, consumer="r0/tp1", producer=0, version=3, group="model.layers.7", chunk=2, data=region)
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

from ..errors import ChunkMacError

__all__ = ["CHUNK_TAG_BYTES", "chunk_key", "chunk_tag", "check_chunk"]

CHUNK_TAG_BYTES = 16
"""Bytes of every chunk's tag."""
_LABEL = b"shardsync chunk mac v1"
_HEAD = struct.Struct("!IqIQH")


def chunk_key(token: str) -> bytes:
    """The group's chunk key, derived from its token (domain-separated from the handshake's and frames' uses)."""
    return hmac.new(token.encode(), _LABEL, hashlib.sha256).digest()


def _view(data: Any) -> memoryview:
    """The bytes of a contiguous uint8 tensor (a GPU chunk is copied to the host: tags cost a device-to-host copy),
    or of anything that exposes the buffer protocol."""
    if hasattr(data, "numpy"):
        if data.device.type != "cpu":
            data = data.cpu()
        return memoryview(data.numpy())
    return memoryview(data)


def chunk_tag(key: bytes, *, producer: int, version: int, group: str, chunk: int, data: Any) -> bytes:
    """The 16-byte tag of ``data``, bound to the producer, version, group, chunk index and length."""
    body = _view(data)
    g = group.encode()
    h = hashlib.blake2b(key=key, digest_size=CHUNK_TAG_BYTES)
    h.update(_HEAD.pack(producer, version, chunk, body.nbytes, len(g)) + g)
    h.update(body)
    return h.digest()


def check_chunk(key: bytes, tag: bytes, *, consumer: str, producer: int, version: int, group: str, chunk: int,
                data: Any) -> None:
    """Raise :class:`ChunkMacError` naming the consumer, producer, group, chunk and version unless ``tag`` is
    ``data``'s tag for them (the key and token are never in the message)."""
    found = chunk_tag(key, producer=producer, version=version, group=group, chunk=chunk, data=data)
    if not hmac.compare_digest(found, bytes(tag)):
        raise ChunkMacError(f"consumer {consumer}: chunk {chunk} of group {group!r} from producer {producer} (version "
                            f"{version}) failed its MAC: these are not the bytes producer {producer} packed for that "
                            "version, group and chunk (changed in transit or in a buffer, or replayed from another "
                            "version, group or producer)")
