"""Tampering on the way, for the MAC tests (``ProducerConfig.mac``): a man-in-the-middle TCP proxy that flips one byte
of a control connection (:class:`MitmProxy`), and, inside a consumer process, chunks replayed with their tags from
another version, group or producer (:class:`ChunkReplay`, driven by ``cluster_procs``' faults).

    with MitmProxy(producer_address, flip_at=FIRST_FRAME_C2S + 5) as px:      # the client's first frame, payload
        ControlClient(px.address, token, peer="producer 0").call(msg, timeout_s=5)   # refused: connection closed
    replay = ChunkReplay()                   # in the consumer's process: records every chunk that passed its check
    replay.arm("version")                    # the next chunk arrives as the same chunk of an earlier version
"""

from __future__ import annotations

import socket
import threading
from typing import Any

__all__ = ["MitmProxy", "ChunkReplay", "FIRST_FRAME_C2S", "FIRST_FRAME_S2C"]

FIRST_FRAME_C2S = 48
"""Stream offset of the client's first frame (after its 48 handshake bytes: nonce + proof)."""
FIRST_FRAME_S2C = 52
"""Stream offset of the server's first frame (after its 19 + 33 handshake bytes)."""
KEEP = 4096
"""Most chunks :class:`ChunkReplay` keeps."""


class MitmProxy:
    """Listens on loopback and relays each connection to ``target``; in the direction ``"c2s"`` (client to server)
    or ``"s2c"``, the byte at stream offset ``flip_at`` of every connection is XORed with 0x01."""

    def __init__(self, target: list[Any], *, flip_at: int, direction: str = "c2s"):
        self.target, self.flip_at, self.direction = (target[0], int(target[1])), flip_at, direction
        self.flipped = 0
        """Bytes flipped so far (one per connection that got that far)."""
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._srv.settimeout(0.2)
        self.address = ["127.0.0.1", self._srv.getsockname()[1]]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="mitm-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            s = socket.create_connection(self.target, timeout=10)
            with self._lock:
                self._socks += [c, s]
            for src, dst, d in ((c, s, "c2s"), (s, c, "s2c")):
                threading.Thread(target=self._pipe, args=(src, dst, d == self.direction), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while True:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                k = self.flip_at - seen
                if flip and 0 <= k < len(data):
                    data[k] ^= 0x01
                    with self._lock:
                        self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # one side gone: the other goes too (as a real middlebox's connection would)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()

    def __enter__(self) -> "MitmProxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ChunkReplay:
    """Wraps ``Puller.verify`` in this (consumer) process: every chunk that passes its check is kept with its tag;
    once :meth:`arm`-ed, the next tagged chunk is replaced, bytes and tag, by a kept one of the same length from an
    earlier version (same producer, group, chunk), another group (same producer, chunk index) or another producer —
    what an attacker who recorded the wire would replay. The consumer must refuse it (``ChunkMacError``)."""

    def __init__(self) -> None:
        from ...engine.consumer.puller import Puller

        self.kept: dict[tuple[int, int, str, int], tuple[Any, bytes]] = {}
        """(producer, version, group, chunk) -> (bytes, tag) of every chunk that passed."""
        self.armed = ""
        self.replayed: list[tuple[int, int, str, int]] = []
        """Where each replayed chunk came from."""
        orig, me = Puller.verify, self

        def verify(puller: Any, data: Any, checksum: int, tag: bytes | None, group: str, chunk: int) -> None:
            if me.armed and tag is not None:
                src = me._pick(puller.p, puller.rnd.version, group, chunk, data.numel())
                if src is not None:
                    me.armed = ""
                    me.replayed.append(src)
                    old, tag = me.kept[src]
                    data.copy_(old)
            orig(puller, data, checksum, tag, group, chunk)
            if tag is not None:
                me.kept[(puller.p, puller.rnd.version, group, chunk)] = (data.clone(), tag)
                while len(me.kept) > KEEP:  # bounded: the oldest go first
                    me.kept.pop(next(iter(me.kept)))

        Puller.verify = verify  # type: ignore[method-assign]

    def arm(self, kind: str) -> None:
        if kind not in ("version", "group", "producer"):
            raise ValueError(f"replay from another version, group or producer, not {kind!r}")
        self.armed = kind

    def _pick(self, p: int, version: int, group: str, chunk: int, n: int) -> tuple[int, int, str, int] | None:
        for key, (old, _) in self.kept.items():
            kp, kv, kg, kc = key
            if old.numel() != n:
                continue
            if (self.armed == "version" and (kp, kg, kc) == (p, group, chunk) and kv != version
                    or self.armed == "group" and kp == p and kc == chunk and kg != group
                    or self.armed == "producer" and kp != p):
                return key
        return None
