"""Source reads, the consumer's side: a group announced where the producer's tensors lie (``Ready.sources``).

The producer (``engine/source_reads/source_share.py``) sends a table: each full tensor's storage (a transport descriptor) and byte
offset. The consumer opens each storage once (``transport.open_shared``), checks every entry against the metadata
(a known name, a storage it sent, the tensor's bytes inside it, aligned for its dtype) and keeps the tensors while the
producer re-sends the same bytes. Then, by how the consumer reads that producer:

* directly (its ring maps onto this consumer's device): :class:`~shardsync.plan.pack.Sources` go to ``apply``, whose
  unpackers replay each scatter's op chain on them straight into the parameters; released once applied;
* through a receive slot, or into a delta consumer's held copy: the chunk is packed here, from the mapped tensors,
  into the slot (the bytes the producer would have packed), then released.

:class:`SourceSink` is that step as the consumer's chunk sink for one producer, wrapped around the sink it reads that
producer with otherwise (``engine/consumer/chunksinks.py``).

The storages stay mapped while some table still names them (``prune`` after each sync)::

    opener = SourceOpener(transport, metas)
    full = opener.tensors(p, "model.layers.3", ready.sources, need=lambda: {"model.layers.3.mlp.up_proj.weight"})
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import torch

from ..protocol import messages as m
from ...errors import ChunkMacError, SyncError, TransportError
from ...plan.pack import GroupPacker, Sources
from ...transport.base import wait_event
from ...types import ParamMeta, dtype_of

if TYPE_CHECKING:
    from ..consumer.pullcontext import PullContext

__all__ = ["SourceOpener", "SourceSink"]


TABLE_ROW_BYTES = 1024
"""Bound on one tensor's share of a ``SourceTable`` beside its name: its row and (at most) one storage descriptor."""
TABLE_SLACK_BYTES = 64 << 10


class SourceOpener:
    def __init__(self, transport: Any, metas: list[ParamMeta], *, who: str):
        self.transport, self.who = transport, who
        self.metas = {x.name: x for x in metas}
        self.max_table_bytes = sum(len(n.encode()) + TABLE_ROW_BYTES for n in self.metas) + TABLE_SLACK_BYTES
        """The largest ``SourceTable`` a producer can honestly send: a row and a storage descriptor per tensor."""
        self._storages: dict[tuple[int, bytes], torch.Tensor] = {}
        self._tables: dict[tuple[int, str], tuple[bytes, Sources, list[tuple[int, bytes]]]] = {}
        self._serial = 0
        self.opened = 0
        """Storages mapped here (summed over syncs): a producer that keeps its tensors adds none after the first."""
        self._packers: dict[str, GroupPacker] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def tensors(self, p: int, group: str, blob: bytes, need: Callable[[], set[str]]) -> Sources:
        """Producer ``p``'s full tensors of ``group`` (at least ``need()``), mapped here, as :class:`Sources` with a
        serial of their own (the same object while the producer re-sends the same bytes); SyncError naming what is
        wrong with a table that does not check out."""
        hit = self._tables.get((p, group))
        if hit is not None and hit[0] == blob:
            return hit[1]
        where = f"{self.who}: producer {p}'s source table of group {group!r}"
        if len(blob) > self.max_table_bytes:  # checked before decoding: nothing is allocated from a peer's claim
            raise SyncError(f"{where} is {len(blob)} bytes; a table of every tensor of the metadata takes at most "
                            f"{self.max_table_bytes}")
        try:
            table = msgspec.msgpack.decode(blob, type=m.SourceTable)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SyncError(f"{where} does not decode: {e}") from None
        if len(table.tensors) > len(self.metas) or len(table.storages) > len(table.tensors):
            raise SyncError(f"{where}: {len(table.tensors)} tensors in {len(table.storages)} storages; the metadata "
                            f"has {len(self.metas)} tensors")
        keys = [(p, msgspec.json.encode(d)) for d in table.storages]
        with self._lock:
            opened = [self._open(p, k, d, where) for k, d in zip(keys, table.storages)]
        out: dict[str, torch.Tensor] = {}
        for name, si, off in table.tensors:
            meta = self.metas.get(name)
            if meta is None or not 0 <= si < len(opened):
                raise SyncError(f"{where}: entry {name[:200]!r} (storage {si}) names no tensor of the metadata or no "
                                "storage of the table")
            buf, dt, n = opened[si], dtype_of(meta.dtype), meta.nbytes
            if off < 0 or off % dt.itemsize or off + n > buf.numel():
                raise SyncError(f"{where}: tensor {name!r} ({meta.dtype}{list(meta.shape)}, {n} bytes) at byte {off} "
                                f"does not fit its {buf.numel()}-byte storage aligned to {dt.itemsize}")
            out[name] = buf[off: off + n].view(dt).view(meta.shape)
        lacking = need() - out.keys()
        if lacking:
            raise SyncError(f"{where} lacks tensors the group's scatters read: {sorted(lacking)[:3]}")
        with self._lock:  # pullers of several producers call this at once: serials stay unique
            self._serial += 1
            src = Sources(out, self._serial)
            self._tables[(p, group)] = (blob, src, keys)
        return src

    def _open(self, p: int, key: tuple[int, bytes], desc: dict[str, Any], where: str) -> torch.Tensor:
        t = self._storages.get(key)
        if t is None:
            if len(self._storages) >= 4 * len(self.metas) + 64:
                raise SyncError(f"{where}: more shared storages open than 4 per tensor of the metadata")
            try:
                t = self._storages[key] = self.transport.open_shared(p, desc)
                self.opened += 1
            except TransportError as e:
                raise SyncError(f"{where}: {e}") from None
        return t

    def packer(self, group: str, plan: Any, layout: Any) -> GroupPacker:
        pk = self._packers.get(group)
        if pk is None or pk.layout is not layout:
            pk = self._packers[group] = GroupPacker(plan.group(group), layout)
        return pk

    def stream(self, dev: torch.device) -> Any:
        mine = getattr(self._local, "streams", None)
        if mine is None:
            mine = self._local.streams = {}
        if dev not in mine:
            mine[dev] = torch.cuda.Stream(dev)
        return mine[dev]

    def prune(self) -> None:
        """Unmap the storages no table names any more (a producer re-allocated its tensors)."""
        with self._lock:
            live = {k for _, _, keys in self._tables.values() for k in keys}
            for k in self._storages.keys() - live:
                del self._storages[k]


class SourceSink:
    """The consumer's chunk sink for producer ``p`` (``engine/consumer/chunksinks.py``) with source reads on top: a
    ``Ready`` that carries a source table is served from the producer's tensors, mapped here by ``opener`` (None: the
    transport cannot map them, and such a ``Ready`` is refused); every other ``Ready`` goes to ``inner``, the sink
    the consumer chose for that producer. Where the mapped tensors go is ``inner.place_sources``'s business: handed to
    ``apply`` where they lie (a direct read), or packed by the ``pack`` it is given into a receive slot or the held
    copy."""

    def __init__(self, inner: Any, opener: SourceOpener | None, ctx: PullContext, p: int):
        self.inner, self.opener, self.ctx, self.p = inner, opener, ctx, p
        self.sourced = 0
        """Groups served from this producer's tensors in this sync."""

    @property
    def wants_sources(self) -> bool:
        """Ask the producer for its tensors (``WaitReady.sources``): they can be mapped here and the inner sink
        leaves what it reads where it lies."""
        return self.opener is not None and self.inner.holds_ring

    @property
    def holds_ring(self) -> bool:
        return self.inner.holds_ring

    @property
    def takes_deltas(self) -> bool:
        return self.inner.takes_deltas

    def read(self, ready: m.Ready, check: Any) -> int:
        """Producer ``p``'s chunks of ``ready.group``: from its source tensors when the ``Ready`` names them, else
        the inner sink's read. Returns the bytes."""
        if not ready.sources:
            return self.inner.read(ready, check)
        ctx, p, group = self.ctx, self.p, ready.group
        if ctx.mac_required():  # source reads carry no keyed tags (producers never serve them with mac)
            raise ChunkMacError(f"consumer {ctx.id}: producer {p} served group {group!r} (version {ready.version}) from "
                                "its source tensors, which carry no keyed tags, and this consumer requires them")
        opener = self.opener
        if opener is None:
            raise SyncError(f"consumer {ctx.id}: producer {p} serves group {group!r} from its source tensors, which "
                            f"transport {ctx.transport.name!r} cannot map here (set ProducerConfig.source_reads=False)")
        chunks = [(ci, chunk) for ci, chunk, *_ in check.announced(ready)]
        gp = ctx.plan.group(group)
        full = opener.tensors(p, group, ready.sources, lambda: {s.src for _, ch in chunks
                                                                 for s in gp.scatters[ch.first:ch.stop]})
        got = sum(ch.nbytes for _, ch in chunks)
        self.sourced += 1
        self.inner.place_sources(group, chunks, full, lambda dsts: self.pack(group, full, dsts))
        return got

    def landed(self, group: str) -> list:
        return self.inner.landed(group)

    def pack(self, group: str, full: Sources, dsts: list) -> None:
        """Pack ``group``'s chunks from the mapped tensors into ``dsts`` ([(chunk, its destination bytes)]: the bytes
        the producer would have packed); on a GPU on this thread's own stream, waited for with a deadline."""
        ctx, opener = self.ctx, self.opener
        assert opener is not None
        pk = opener.packer(group, ctx.plan, ctx.layouts[group])
        dev = dsts[0][1].device if dsts else torch.device("cpu")
        if dev.type != "cuda":
            for ch, dst in dsts:
                pk.pack(full.tensors, dst, ch, base=ch.start)
            return
        s = opener.stream(dev)  # the apply runs on the lane meanwhile
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for ch, dst in dsts:
                pk.pack(full.tensors, dst, ch, base=ch.start)
            ev = torch.cuda.Event()
            ev.record(s)
        wait_event(ev, timeout_s=ctx.timeout_s, what=f"consumer {ctx.id}: packing group {group!r} from producer "
                                                     f"{self.p}'s tensors")
