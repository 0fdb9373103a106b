"""Ray Direct Transport (RDT, NIXL underneath): a consumer inside Ray pulls ranges of a producer actor's buffer.

For producers that are Ray actors. The producer's actor class inherits :class:`RdtServing` and is declared
``@ray.remote(enable_tensor_transport=True, max_concurrency=N)`` with N >= 2: consumers' reads are actor calls
that must run while the actor is inside ``Producer.sync``. ``register`` must run inside that actor. A consumer (an actor
or a driver connected to the same cluster) calls the producer's ``shardsync_rdt_read`` and has Ray's
transport land the bytes straight into its receive buffer (``ray.experimental.set_target_for_ref``: a
one-sided NIXL read on the consumer's side); a dead producer actor fails the read with
:class:`~shardsync.errors.TransportError` at once, a stuck one at ``timeout_s``::

    @ray.remote(enable_tensor_transport=True, max_concurrency=4)
    class Trainer(RdtServing): ...           # the producer's transport="rdt"

Measured against the direct transports in README ("Ray"): each read is a Ray actor call plus NIXL's own
set-up, so the direct ``tcp``/``nixl`` transports stay the default inside Ray deployments.
"""

from __future__ import annotations

import base64
import threading
import uuid
from typing import Any

import torch

from ..errors import TransportError
from .base import Caps, check_range

__all__ = ["RdtTransport", "RdtServing"]

_BUFFERS: dict[str, torch.Tensor] = {}
_LOCK = threading.Lock()


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TransportError(f"the rdt transport needs Ray (pip install shardsync[ray]): {e}") from e
    if not ray.is_initialized():
        raise TransportError("the rdt transport runs inside Ray: ray.init() (or a Ray actor) first")
    return ray


try:  # the serving method carries its transport; without Ray the mixin is inert
    import ray as _ray_mod

    _nixl_method: Any = _ray_mod.method(tensor_transport="nixl")
except ImportError:  # pragma: no cover - depends on the environment
    def _nixl_method(f: Any) -> Any:
        return f


class RdtServing:
    """Mixin for a producer's Ray actor class: the method consumers call to read its registered buffer (a
    module-level class, so that Ray refers to it by name and the method sees this module's buffers)."""

    @_nixl_method
    def shardsync_rdt_read(self, key: str, offset: int, nbytes: int) -> torch.Tensor:
        buf = _BUFFERS.get(key)
        if buf is None:
            raise TransportError(f"rdt: no buffer {key!r} registered in this actor (closed, or restarted)")
        if offset < 0 or nbytes < 0 or offset + nbytes > buf.numel():
            raise TransportError(f"rdt: read [{offset}, {offset + nbytes}) is outside a {buf.numel()}-byte buffer")
        return buf[offset: offset + nbytes]


def _pin(ray: Any, t: torch.Tensor) -> None:
    """Register ``t``'s memory with NIXL for the life of the process (by default Ray registers each RDT object's
    memory and deregisters it when the object goes: concurrent reads of views of one buffer then race)."""
    try:
        ray.experimental.register_nixl_memory(t)
    except Exception as e:
        raise TransportError(f"rdt: cannot register {t.numel()} bytes with NIXL: {e}") from None


class RdtTransport:
    name = "rdt"
    caps = Caps(one_sided=True, gpu=True, can_abort=True)

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._peers: dict[int, tuple[Any, str, int]] = {}
        self._pinned: dict[int, torch.Tensor] = {}

    def register(self, buf: torch.Tensor) -> dict[str, Any]:
        ray = _ray()
        if buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise TransportError("rdt registers contiguous uint8 buffers only")
        try:
            me = ray.get_runtime_context().current_actor
        except Exception as e:
            raise TransportError(f"rdt: register() must run inside the producer's Ray actor: {e}") from None
        if not hasattr(me, "shardsync_rdt_read"):
            raise TransportError("rdt: the producer's actor class must inherit shardsync.transport.rdt.RdtServing "
                                 "(and be declared @ray.remote(enable_tensor_transport=True))")
        key = uuid.uuid4().hex
        _pin(ray, buf)  # registered once for the process: reads of overlapping views never deregister it
        with _LOCK:
            _BUFFERS[key] = buf
        self._keys.append(key)
        handle = base64.b64encode(ray.cloudpickle.dumps(me)).decode()
        return {"actor": handle, "key": key, "nbytes": buf.numel()}

    def connect(self, producer: int, desc: dict[str, Any]) -> None:
        ray = _ray()
        try:
            handle = ray.cloudpickle.loads(base64.b64decode(desc["actor"]))
        except Exception as e:
            raise TransportError(f"rdt: producer {producer}'s descriptor holds no actor handle: {e}") from None
        handle._ray_enable_tensor_transport = True  # the transport is declared on the method itself
        self._peers[producer] = (handle, str(desc["key"]), int(desc["nbytes"]))

    def read(self, producer: int, offset: int, nbytes: int, into: torch.Tensor, *, timeout_s: float) -> None:
        peer = self._peers.get(producer)
        if peer is None:
            raise TransportError(f"rdt: producer {producer} is not connected")
        handle, key, size = peer
        check_range(size, offset, nbytes, into, f"producer {producer}")
        if nbytes == 0:
            return
        ray = _ray()
        what = f"rdt: read [{offset}, {offset + nbytes}) from producer {producer}"
        dst = into[:nbytes]
        st = into.untyped_storage()
        if st.data_ptr() not in self._pinned:  # a receive buffer: its whole allocation registered once
            whole = torch.empty(0, dtype=torch.uint8, device=into.device).set_(st)
            _pin(ray, whole)
            self._pinned[st.data_ptr()] = whole
        try:
            ref = handle.shardsync_rdt_read.remote(key, offset, nbytes)
            ray.experimental.set_target_for_ref(ref, [dst])
            out = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TransportError(f"{what} did not complete within {timeout_s} s") from None
        except Exception as e:
            raise TransportError(f"{what} failed: {type(e).__name__}: {str(e)[-600:]}") from None
        if out.data_ptr() != dst.data_ptr():  # the transport did not land it in place
            dst.copy_(out)

    def close(self) -> None:
        with _LOCK:
            for k in self._keys:
                _BUFFERS.pop(k, None)
        self._keys.clear()
        self._peers.clear()
