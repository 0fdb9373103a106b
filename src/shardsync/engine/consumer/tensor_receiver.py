"""A consumer whose "engine" is a set of full receive tensors, for frameworks that load ``(name, tensor)`` pairs.

verl's rollout workers and SkyRL's vLLM workers want ``(name, full tensor)`` pairs (the framework then loads them
into its inference engine), so this consumer's plan is the identity: recorded by a dry run of a loader that copies
each checkpoint tensor whole into a receive tensor of the same name, dtype and shape (``record_plan``, the same
recording every shardsync consumer uses). Each sync pulls every group from the trainer rank(s) that serve it; as
soon as a group has been unpacked its names are queued, and the reader takes them while later groups are still in
flight.

Memory: the receive tensors are one full copy of the model, allocated once (at the first update) on ``device`` and
reused every update; a tensor handed out is valid until the next update overwrites it (the frameworks copy what
they are given into their engine). With delta sync they are also the deltas' base: no held copy beside them (a
tensor changed in place by its reader is noticed by the delta's check and read dense).

    rx = Receiver("rollout0", coordinator, settings=GroupSettings(token=token, timeout_s=60))
    rx.start(version=1)                   # consumer init (first time) + sync in a background thread
    for names in rx.groups(wait_s=65):    # group by group, as they land
        ...
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator, Sequence

import torch

from ...config import GroupSettings
from .consumer import Consumer
from ...errors import SyncError, TransportError
from ...plan.pack import GroupUnpacker
from ...plan.readback import ParamsReadBack
from ...plan.record import record_plan
from ...plan.split import split_to_budget
from ...types import ParamMeta, Plan, dtype_of

__all__ = ["Receiver"]

_DONE = object()


class Receiver:
    def __init__(self, consumer_id: str, coordinator: list[Any], *, settings: GroupSettings,
                 device: str | None = None, recv_slots: int = 4):
        self.id, self.device, self.timeout_s = consumer_id, device, settings.timeout_s
        self.sync_memory_bytes = settings.sync_memory_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self._unpackers: dict[str, GroupUnpacker] = {}
        self._q: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.stats: dict[str, Any] = {}
        self.consumer = Consumer(consumer_id, coordinator, record=self._record, apply=self._apply, settings=settings,
                                 recv_slots=recv_slots, device=device,
                                 read_back=lambda plan: ParamsReadBack(plan, self.tensors, self.tensors.keys()))
        self._inited = False

    # ---------------------------------------------------------------- the consumer's two callbacks
    def _record(self, metas: Sequence[ParamMeta]) -> Plan:
        self.tensors = {m.name: torch.empty(m.shape, dtype=dtype_of(m.dtype), device=self.device or "cpu")
                        for m in metas}

        def load_whole(weights: Any) -> None:
            for name, t in weights:
                self.tensors[name].copy_(t)

        plan = record_plan(metadata=metas, load_weights=load_whole, params=self.tensors, consumer=self.id)
        return split_to_budget(plan, metas, self.sync_memory_bytes)

    def _apply(self, group: str, buf: torch.Tensor) -> None:
        u = self._unpackers.get(group)
        if u is None:
            u = self._unpackers[group] = GroupUnpacker(self.consumer.plan.group(group), self.consumer.layouts[group])
        u.unpack(buf, self.tensors)
        self._q.put(list(self.consumer.plan.group(group).sources))

    # ---------------------------------------------------------------- one update
    def start(self, version: int) -> None:
        """Init the consumer on the first update, then run ``sync(version)`` in the background."""
        if self._thread is not None and self._thread.is_alive():
            raise SyncError(f"consumer {self.id}: the previous update is still being received")

        def run() -> None:
            try:
                if not self._inited:
                    self.consumer.init()
                    self._inited = True
                self.stats = self.consumer.sync(version)
                self._q.put(_DONE)
            except BaseException as e:  # handed to the reader, which raises it
                self._q.put(e)

        self._q = queue.Queue()
        self._thread = threading.Thread(target=run, name=f"shardsync-receiver-{self.id}", daemon=True)
        self._thread.start()

    def next_group(self, wait_s: float) -> list[str] | None:
        """The names of the next group that landed; None once the update is complete. Raises what the sync
        raised, or TransportError if nothing happened for ``wait_s`` seconds."""
        try:
            item = self._q.get(timeout=wait_s)
        except queue.Empty:
            raise TransportError(f"consumer {self.id}: no weight group landed within {wait_s:.1f} s "
                                 f"(receiving version {self.consumer.version + 1})") from None
        if item is _DONE:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def groups(self, wait_s: float) -> Iterator[list[str]]:
        while (names := self.next_group(wait_s)) is not None:
            yield names

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
        self.consumer.close(goodbye=self._inited)
