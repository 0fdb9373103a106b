"""NCCL transport: point-to-point sends from a producer's GPU ring, one communicator per producer–consumer pair.

Two-sided underneath, one-sided to the engine: the producer serves a small request socket; a consumer
asks for a range on it and posts the matching receive while the producer posts the send. Each pair gets
its own two-rank process group (rank 0 producer, rank 1 consumer), rendezvousing through a store the
producer hosts, built when the consumer connects — so consumers need no shared world, join and leave
freely, and several consumers on ONE GPU work (NCCL refuses two ranks of one communicator on the same
GPU; here every communicator has one rank on the producer's GPU and one on the consumer's). A producer
and a consumer on the same GPU cannot pair: use ``cuda_ipc`` for colocated engines.

Every wait polls with a deadline; a read that times out aborts its pair's communicator and fails with
:class:`~shardsync.errors.TransportError`. ``backend="gloo"`` runs the same protocol on CPU tensors
(the contract tests in CI)::

    t = NcclTransport(host="10.0.0.5", token="s3cret")
    desc = t.register(ring)                                         # producer, ring on cuda:0
    t = NcclTransport(token="s3cret"); t.connect(0, desc)           # consumer (cuda:1)
    t.read(0, off, n, recv_slot, timeout_s=30)
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TransportError
from .base import Caps, check_range, poll
from ..security.admission import Admission, accept_loop
from .tcp import advertised, recv_exact, send_token, token_ok

__all__ = ["NcclTransport"]

_REQ = struct.Struct("!QQQ")  # offset, nbytes, the consumer's timeout in ms
_OK, _ERR = b"K", b"E"
_KEY = 32
_TAG = 0
_WATCHDOG_S = 6 * 3600
log = logging.getLogger("shardsync.transport.nccl")


def _pair_group(backend: str, store: Any, key: str, rank: int, timeout_s: float) -> Any:
    st = dist.PrefixStore(f"shardsync/{key}/", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupGloo(st, rank, 2, opts)
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise TransportError("nccl transport: this torch has no NCCL (a CPU build?); use backend='gloo' or tcp")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=_WATCHDOG_S)  # our own polls time reads out; the watchdog must not kill us
    return dist.ProcessGroupNCCL(st, rank, 2, opts)


def _finish(work: Any, backend: str, timeout_s: float, what: str) -> None:
    """Wait for one send/recv: NCCL's completion is an event polled with a deadline; gloo's wait takes one."""
    if backend == "gloo":
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise TransportError(f"{what} failed or timed out after {timeout_s} s: {e}") from None
        return
    poll(work.is_completed, timeout_s=timeout_s, what=lambda: f"{what} did not complete within {timeout_s} s")
    work.wait()  # orders the caller's stream after it (no host wait: it has completed)


def _abort(pg: Any) -> None:
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:
                pass
            return


class NcclTransport:
    name = "nccl"
    caps = Caps(one_sided=False, gpu=True, can_abort=True, takes_token=True)

    def __init__(self, *, host: str = "127.0.0.1", token: str = "", advertise_host: str | None = None,
                 backend: str = "nccl", connect_timeout_s: float = 60.0, auth_timeout_s: float = 10.0):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"nccl transport backend must be 'nccl' or 'gloo', got {backend!r}")
        self.host, self.token, self.advertise_host, self.backend = host, token, advertise_host, backend
        self.connect_timeout_s, self.auth_timeout_s = connect_timeout_s, auth_timeout_s
        self.refused = 0
        self._buf: torch.Tensor | None = None
        self._device = torch.device("cpu")
        self._desc: dict[str, Any] = {}
        self._server: socket.socket | None = None
        self._store: Any = None
        self._closed = threading.Event()
        self._peers: dict[int, tuple[socket.socket, Any, threading.Lock, int]] = {}
        self._served: list[tuple[socket.socket, Any]] = []

    # ------------------------------------------------------------ producer
    def register(self, buf: torch.Tensor) -> dict[str, Any]:
        if buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise TransportError("nccl transport registers contiguous uint8 buffers only")
        if self.backend == "nccl" and not buf.is_cuda:
            raise TransportError("nccl transport: the registered buffer must be on a CUDA device (backend='gloo' "
                                 "serves CPU buffers)")
        if self._server is not None:  # serving already: the buffer replaces the one retired (same port, same pairs)
            if self._buf is not None or buf.device != self._device:
                have = "one" if self._buf is not None else "none"
                raise TransportError(f"nccl: registers one buffer at a time on one device (have {have} on "
                                     f"{self._device}; retire it first)")
            self._buf = buf
            return {**self._desc, "nbytes": buf.numel()}
        self._buf, self._device = buf, buf.device
        self._store = dist.TCPStore(self.host, 0, None, True, timeout=timedelta(seconds=self.connect_timeout_s),
                                    wait_for_workers=False)
        self._server = socket.create_server((self.host, 0))
        self._server.settimeout(0.2)
        self.admission = Admission("nccl-serve", deadline_s=self.auth_timeout_s)
        threading.Thread(target=accept_loop, args=(self._server, self._closed, self._serve, "shardsync-nccl-serve",
                                                   self.admission), name="shardsync-nccl-accept", daemon=True).start()
        self._desc = {"host": advertised(self.host, self.advertise_host), "port": self._server.getsockname()[1],
                      "store_port": self._store.port, "nbytes": buf.numel(), "backend": self.backend,
                      "device": str(buf.device)}
        return dict(self._desc)

    def retire(self, desc: dict[str, Any]) -> bool:
        """Stop serving the registered buffer (reads of it are refused) until ``register`` names the next one: the
        server, its port and the consumers' pairs stay."""
        if self._buf is None or desc.get("port") != self._desc["port"]:
            return False
        self._buf = None
        return True

    def _serve(self, conn: socket.socket) -> None:
        pg = None
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        with conn:
            try:
                if not token_ok(conn, self.token, self.auth_timeout_s, self._refuse):
                    return
                key = recv_exact(conn, _KEY).decode()
                self.admission.passed(conn)
                pg = _pair_group(self.backend, self._store, key, 0, self.connect_timeout_s)
                self._served.append((conn, pg))
                conn.settimeout(None)
                while not self._closed.is_set():
                    off, n, timeout_ms = _REQ.unpack(recv_exact(conn, _REQ.size))
                    buf = self._buf  # read per request: a retired buffer is replaced in place
                    if buf is None or off + n > buf.numel() or n == 0:
                        conn.sendall(_ERR)
                        continue
                    conn.sendall(_OK)
                    _finish(pg.send([buf[off: off + n]], 1, _TAG), self.backend, timeout_ms / 1000,
                            f"nccl: send [{off}, {off + n}) to consumer {key[:8]}")
            except (ConnectionError, OSError, TransportError):
                if pg is not None:
                    _abort(pg)  # the consumer went away or stalled: its communicator is dead
            except Exception:
                log.exception("nccl transport: serving thread failed")
                if pg is not None:
                    _abort(pg)
            finally:
                self.admission.release(conn)

    def _refuse(self) -> None:
        self.refused += 1
        self.admission.refuse("token")

    # ------------------------------------------------------------ consumer
    def connect(self, producer: int, desc: dict[str, Any]) -> None:
        if desc.get("backend", "nccl") != self.backend:
            raise TransportError(f"nccl: producer {producer} serves backend {desc.get('backend')!r}, this consumer "
                                 f"uses {self.backend!r}")
        key = uuid.uuid4().hex
        try:
            s = socket.create_connection((desc["host"], int(desc["port"])), timeout=self.connect_timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not send_token(s, self.token, key.encode()):
                raise TransportError(f"nccl: producer {producer} at {desc['host']}:{desc['port']} rejected the token")
            store = dist.TCPStore(desc["host"], int(desc["store_port"]), None, False,
                                  timeout=timedelta(seconds=self.connect_timeout_s))
            pg = _pair_group(self.backend, store, key, 1, self.connect_timeout_s)
        except (OSError, ConnectionError, RuntimeError) as e:
            raise TransportError(f"nccl: cannot connect to producer {producer} at {desc.get('host')}:"
                                 f"{desc.get('port')}: {e}") from None
        self._drop(producer)  # a restarted producer: its predecessor's pair is stale
        self._peers[producer] = (s, pg, threading.Lock(), int(desc["nbytes"]))

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None:
        peer = self._peers.get(producer)
        if peer is None:
            raise TransportError(f"nccl: producer {producer} is not connected")
        s, pg, lock, size = peer
        check_range(size, offset, nbytes, into, f"producer {producer}")
        if nbytes == 0:
            return
        what = f"nccl: read [{offset}, {offset + nbytes}) from producer {producer}"
        with lock:
            try:
                s.settimeout(timeout_s)
                s.sendall(_REQ.pack(offset, nbytes, int(timeout_s * 1000)))
                if recv_exact(s, 1) != _OK:
                    raise TransportError(f"{what}: refused")
                _finish(pg.recv([into[:nbytes]], 0, _TAG), self.backend, timeout_s, what)
            except (socket.timeout, OSError, ConnectionError) as e:
                self._drop(producer)
                raise TransportError(f"{what} failed: {e or 'timed out'}") from None
            except TransportError:
                self._drop(producer)
                raise

    def _drop(self, producer: int) -> None:
        peer = self._peers.pop(producer, None)
        if peer is not None:
            _abort(peer[1])
            try:
                peer[0].close()
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        if getattr(self, "admission", None) is not None:
            self.admission.close()
        if self._server is not None:
            self._server.close()
        for p in list(self._peers):
            self._drop(p)
        for conn, pg in self._served:
            _abort(pg)
            try:
                conn.close()
            except OSError:
                pass
        self._served.clear()
