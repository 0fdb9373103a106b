"""Source reads, the consumer's side: a group announced where the producer's tensors lie (``Ready.sources``).

The producer (``engine/source_reads/source_share.py``) sends a table: each full tensor's storage (a transport descriptor) and byte
offset. The consumer opens each storage once (``transport.open_shared``), checks every entry against the metadata
(a known name, a storage it sent, the tensor's bytes inside it, aligned for its dtype) and keeps the tensors while the
producer re-sends the same bytes. Then, by how the consumer reads that producer:

* directly (its ring maps onto this consumer's device): :class:`~shardsync.plan.pack.Sources` go to ``apply``, whose
  unpackers replay each scatter's op chain on them straight into the parameters; released once applied;
* through a receive slot, or into a delta consumer's held copy: the chunk is packed here, from the mapped tensors,
  into the slot (the bytes the producer would have packed), then released.

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
from ...errors import SyncError, TransportError
from ...plan.pack import GroupPacker, Sources
from ...transport.base import wait_event
from ...types import ParamMeta, dtype_of

if TYPE_CHECKING:
    from ..consumer.puller import Puller

__all__ = ["SourceOpener", "read_sources"]


class SourceOpener:
    def __init__(self, transport: Any, metas: list[ParamMeta], *, who: str):
        self.transport, self.who = transport, who
        self.metas = {x.name: x for x in metas}
        self._storages: dict[tuple[int, bytes], torch.Tensor] = {}
        self._tables: dict[tuple[int, str], tuple[bytes, Sources, list[tuple[int, bytes]]]] = {}
        self._serial = 0
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


def read_sources(pl: Puller, ready: m.Ready) -> int:
    """Producer ``pl.p``'s chunks of ``ready.group``, served from its source tensors: handed to ``apply`` where they
    lie (direct), or packed here into the receive slot / held copy. Returns the bytes."""
    c, rnd, p, group = pl.c, pl.rnd, pl.p, ready.group
    opener: SourceOpener | None = c.sources
    if opener is None:
        raise SyncError(f"consumer {c.id}: producer {p} serves group {group!r} from its source tensors, which "
                        f"transport {c.transport.name!r} cannot map here (set ProducerConfig.source_reads=False)")
    chunks = [(ci, chunk) for ci, chunk, *_ in pl.announced(ready)]
    gp = c.plan.group(group)
    full = opener.tensors(p, group, ready.sources, lambda: {s.src for _, ch in chunks
                                                             for s in gp.scatters[ch.first:ch.stop]})
    got = sum(ch.nbytes for _, ch in chunks)
    with rnd._lock:
        rnd.sourced += 1
    if c.held is None and p in rnd.direct:
        rnd.read_directly(p, group, [(ch, full) for _, ch in chunks])
        return got
    pk = opener.packer(group, c.plan, c.layouts[group])
    if c.held is not None:  # a delta consumer: the chunk's dense bytes into its held copy
        dsts = [(ch, c.held.view(group, ci)) for ci, ch in chunks]
        for ci, _ in chunks:
            c.held.touch(group, ci)
    else:
        assert rnd.slots is not None
        buf = c.slots[rnd.slots.acquire(group, timeout_s=c.timeout_s, abort=rnd.failing,
                                        what=f"group {group!r} of version {rnd.version}")]
        dsts = [(ch, buf[ch.start: ch.start + ch.nbytes]) for _, ch in chunks]
    dev = dsts[0][1].device if dsts else torch.device("cpu")
    if dev.type != "cuda":
        for ch, dst in dsts:
            pk.pack(full.tensors, dst, ch, base=ch.start)
    else:  # this puller's own stream (the apply runs on the lane meanwhile), waited for with a deadline
        s = opener.stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for ch, dst in dsts:
                pk.pack(full.tensors, dst, ch, base=ch.start)
            ev = torch.cuda.Event()
            ev.record(s)
        wait_event(ev, timeout_s=c.timeout_s, what=f"consumer {c.id}: packing group {group!r} from producer {p}'s "
                                                   "tensors")
    if c.held is not None:
        c.held.count(delta_dense_chunks=len(chunks), delta_dense_bytes=got)
    return got
