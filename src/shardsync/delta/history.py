"""The bytes last served of every chunk a producer serves, kept as delta bases, within a stated budget.

One arena (device memory, or pinned host memory) holds every registered chunk, keyed ``(plan digest, group, chunk
index)``; each chunk carries the version its bytes are. A version runs transactionally::

    hist = DeltaHistory.from_layouts({digest: layouts}, budget_bytes=8 << 30, device="cuda:0")  # refused above it
    hist.begin(7)
    enc = hist.encode((digest, "model.layers.0", 0), packed_chunk, checksum=True)  # against version 6, or dense
    ...                                      # serve enc to every consumer that completed version 6 (dense to others)
    hist.commit(7)                           # or hist.rollback(): version 6 stays the base, byte for byte

``encode`` updates the base in place as it goes and logs what it overwrote in an undo journal (the changed words'
old values: no larger than the delta itself; a dense chunk's old bytes). The journal lives in what the budget leaves
beyond the chunks (at most as much again); a chunk whose undo did not fit is dropped on rollback instead (its next
delta base is none: dense), so a failed version never becomes a base either way.

A consumer can keep its held bytes the same way: ``apply`` validates a received delta against the version it holds
(``DeltaMismatch`` otherwise), applies it with undo, and checks the producer's checksum.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from . import codec
from ..errors import DeltaBudgetError, DeltaError, DeltaMismatch
from ..plan.pack import ALIGN, GroupLayout

__all__ = ["Key", "DeltaHistory", "chunk_sizes"]

Key = tuple[str, str, int]
"""(plan digest or route key, group, chunk index)."""


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


def chunk_sizes(layouts: Mapping[str, Mapping[str, GroupLayout]], only: Iterable[Key] | None = None) -> dict[Key, int]:
    """``{(digest, group, chunk index): nbytes}`` of every chunk of ``layouts`` (digest -> group -> layout), or of
    those in ``only`` (the chunks routed to this producer)."""
    keep = None if only is None else set(only)
    return {(d, g, c.index): c.nbytes for d, lays in layouts.items() for g, lay in lays.items() for c in lay.chunks
            if keep is None or (d, g, c.index) in keep}


class DeltaHistory:
    """Delta bases of a fixed set of chunks, one arena allocated once (see the module docstring)."""

    def __init__(self, chunks: Mapping[Key, int], *, budget_bytes: int, device: str | torch.device = "cpu",
                 pin_memory: bool = False):
        self.device = torch.device(device)
        self.offsets: dict[Key, int] = {}
        self.sizes: dict[Key, int] = dict(chunks)
        need = 0
        for k, nb in self.sizes.items():
            if type(nb) is not int or nb < 0:
                raise DeltaError(f"chunk {k}: size {nb!r} is not a byte count")
            self.offsets[k] = need
            need += _align(nb)
        if budget_bytes < need:
            raise DeltaBudgetError(budget=budget_bytes, need=need)
        self.need, self.budget = need, budget_bytes
        self.pinned = bool(pin_memory and self.device.type == "cpu" and torch.cuda.is_available())
        self._arena = torch.empty(need, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)
        self._journal = torch.empty(min(budget_bytes - need, need), dtype=torch.uint8, device=self.device,
                                    pin_memory=self.pinned)
        self._version: dict[Key, int | None] = dict.fromkeys(self.sizes)
        self._pending: int | None = None
        self._last: int | None = None
        self._undo: dict[Key, tuple[int, int, int] | None] = {}  # key -> (journal offset, words, kind) or None
        self._hashes: dict[Key, int | None] = {}
        """The word hash of a chunk's stored bytes, where an encode computed it (a GPU chunk's checksum): the next
        checksum is folded from it (``kernels/word_delta.py``), not hashed."""
        self._hash_undo: dict[Key, int | None] = {}
        self._jpos = 0
        self._scratch: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def from_layouts(cls, layouts: Mapping[str, Mapping[str, GroupLayout]], *, only: Iterable[Key] | None = None,
                     **kw) -> "DeltaHistory":
        """A history of the chunks of ``layouts`` (digest -> group -> layout), or of those in ``only``."""
        return cls(chunk_sizes(layouts, only), **kw)

    # ------------------------------------------------------------------------------------------- state
    @property
    def journal_bytes(self) -> int:
        return self._journal.numel()

    @property
    def pending(self) -> int | None:
        """The version being served (between ``begin`` and ``commit``/``rollback``), else None."""
        return self._pending

    def version(self, key: Key) -> int | None:
        """The version of ``key``'s stored bytes (None: no base; its next chunk goes dense)."""
        return self._version[self._known(key)]

    def held(self, key: Key) -> torch.Tensor:
        """The stored bytes of ``key`` (a view into the arena; do not write to it)."""
        off = self.offsets[self._known(key)]
        return self._arena[off: off + self.sizes[key]]

    def invalidate(self, keys: Iterable[Key] | None = None) -> None:
        """Drop the bases of ``keys`` (all when None): e.g. after a plan change; their next chunks go dense."""
        for k in (self.sizes if keys is None else keys):
            self._version[self._known(k)] = None
            self._hashes.pop(k, None)

    def _known(self, key: Key) -> Key:
        if key not in self.sizes:
            raise DeltaError(f"chunk {key} is not one this delta history was built for")
        return key

    # ------------------------------------------------------------------------------------------- versions
    def begin(self, version: int) -> None:
        """Start serving ``version`` (greater than every committed one)."""
        if self._pending is not None:
            raise DeltaError(f"delta history: version {self._pending} is still open (commit or roll it back first)")
        if self._last is not None and version <= self._last:
            raise DeltaError(f"delta history: version {version} is not after the last committed {self._last}")
        self._pending, self._undo, self._jpos, self._hash_undo = version, {}, 0, {}

    def commit(self, version: int) -> None:
        """Every chunk encoded (or applied) since ``begin(version)`` now holds ``version``: the next base."""
        self._open(version)
        for k in self._undo:
            self._version[k] = version
        self._last, self._pending, self._undo, self._jpos, self._hash_undo = version, None, {}, 0, {}

    def rollback(self) -> None:
        """Undo every chunk touched since ``begin``: restored byte for byte from the journal, or dropped (no base)
        where its undo did not fit. Untouched chunks keep their bases."""
        if self._pending is None:
            return
        self._hashes.update(self._hash_undo)
        for k, undo in reversed(list(self._undo.items())):
            if undo is None:
                self._version[k] = None
                self._hashes.pop(k, None)
                continue
            off, words, kind = undo
            dst = self.held(k)
            if kind == 0:  # dense: the whole old chunk
                dst.copy_(self._journal[off: off + dst.numel()])
                continue
            w = codec.word_size(dst.numel())
            idx = self._journal[off: off + 4 * words].view(torch.int32).long()
            vals = self._journal[off + 4 * words: off + (4 + w) * words]
            codec.apply_changes(dst, idx, vals.view(torch.int16) if w == 2 else vals)
        self._pending, self._undo, self._jpos, self._hash_undo = None, {}, 0, {}

    def _open(self, version: int | None = None) -> None:
        if self._pending is None or (version is not None and version != self._pending):
            raise DeltaError(f"delta history: version {version if version is not None else '?'} is not open "
                             f"(open: {self._pending})")

    def _touch(self, key: Key) -> torch.Tensor:
        self._open()
        if key in self._undo:
            raise DeltaError(f"chunk {key}: already updated in version {self._pending} (encode once, serve the "
                             "result to every consumer on that base)")
        self._hash_undo[key] = self._hashes.get(key)
        return self.held(key)

    def _log(self, key: Key, dst: torch.Tensor, idx: torch.Tensor | None) -> None:
        """Journal what the update of ``key`` at ``idx`` (all of it when None) is about to overwrite."""
        w = codec.word_size(dst.numel())
        if idx is not None and (4 + w) * idx.numel() >= dst.numel():
            idx = None  # the old bytes themselves are the smaller undo
        size = dst.numel() if idx is None else (4 + w) * idx.numel()
        start = _align(self._jpos)
        if self._version[key] is None or start + size > self._journal.numel():
            self._undo[key] = None  # nothing worth keeping, or no room: dropped on rollback
            return
        j = self._journal[start: start + size]
        if idx is None:
            j.copy_(dst)
            self._undo[key] = (start, 0, 0)
        else:
            k = idx.numel()
            j[: 4 * k].view(torch.int32).copy_(idx)
            words = dst.view(torch.int16) if w == 2 else dst
            j[4 * k:].view(words.dtype).copy_(words.index_select(0, idx))
            self._undo[key] = (start, k, 1)
        self._jpos = start + size

    # ------------------------------------------------------------------------------------------- use
    def encode(self, key: Key, new: torch.Tensor, *, checksum: bool | int = False,
               out: torch.Tensor | None = None) -> codec.Encoded:
        """Producer: ``new`` (this version's packed chunk, on any device) as the smallest form against the stored
        base (dense without one); the base becomes ``new`` (undone by ``rollback``). ``checksum``: as for
        ``codec.encode`` (an int: ``new``'s xxh3-64, computed by the caller). ``out``: where a delta's payload goes
        (one that does not fit is given as dense); a dense chunk's payload is ``new`` itself."""
        return self.encode_many([(key, new, checksum)], area=out)[0][0]

    def encode_many(self, items: list[tuple[Key, torch.Tensor, bool | int]], *,
                    area: torch.Tensor | None = None) -> list[tuple[codec.Encoded, int | None]]:
        """:meth:`encode` of every ``(key, new, checksum)`` of ``items`` (a group's chunks), their changes found
        together: on CUDA one host sync for all of them, not one per chunk. ``area``: where the deltas' payloads
        go, one after the other at ``ALIGN``-ed offsets; a delta whose payload does not fit in what is left is given
        as dense, writing nothing there. Without ``area`` each payload is a new tensor. Returns per chunk its
        encoding and where in ``area`` its payload starts (None: dense, or no area)."""
        rows = []
        if len({key for key, _, _ in items}) != len(items):
            raise DeltaError("a chunk appears twice in one encode (encode once, serve the result to every consumer)")
        for key, new, cs in items:
            dst = self._touch(key)
            if new.numel() != dst.numel():
                raise DeltaError(f"chunk {key}: {new.numel()} bytes packed, {dst.numel()} registered")
            rows.append((key, new, cs, dst, self._version[key]))
        todo = [i for i, r in enumerate(rows) if r[4] is not None]
        here = [i for i in todo if rows[i][1].device == rows[i][3].device]
        found = dict(zip(here, codec.find_changes_many([(rows[i][1], rows[i][3]) for i in here])))
        for i in todo:  # a host history beside device chunks: each base through the one scratch buffer in turn
            if i not in found:
                new, dst = rows[i][1], rows[i][3]
                found[i] = codec.find_changes(new, self._scratch_for(new.device, dst.numel()).copy_(dst))
        out, pos = [], 0
        for i, (key, new, cs, dst, base) in enumerate(rows):
            n = new.numel()
            at = None
            if base is None:
                enc = codec.dense(new, checksum=cs)
            else:
                idx, vals, hdelta = found[i]
                k = idx.numel()
                kind = codec.choose(n, k)
                size = codec.payload_nbytes(kind, n, k)
                at = pos if area is not None else None
                if kind != codec.DENSE and (area is None or pos + size <= area.numel()):
                    enc = codec.encode_changes(new, idx, vals, base=base, checksum=cs,
                                               out=None if area is None else area[pos: pos + size],
                                               base_hash=self._hashes.get(key), hash_delta=hdelta)
                    pos = _align(pos + size)
                else:  # dense, or a delta with no room left: the dense bytes (its checksum folded all the same)
                    at = None
                    csum, algo = codec.new_checksum(new, cs, base_hash=self._hashes.get(key), hash_delta=hdelta)
                    enc = codec.Encoded(codec.DeltaHeader(kind=codec.DENSE, nbytes=n, count=n // codec.word_size(n),
                                                          checksum=csum, hash=algo), new, k)
            self._keep_hash(key, enc.header)
            if enc.header.kind == codec.DENSE:
                self._log(key, dst, None)
                dst.copy_(new)
            else:
                idx, vals = found[i][0].to(dst.device), found[i][1].to(dst.device)
                self._log(key, dst, idx)
                codec.apply_changes(dst, idx, vals)
            out.append((enc, at))
        return out

    def _keep_hash(self, key: Key, h: codec.DeltaHeader) -> None:
        if h.hash == codec.WORD and h.checksum is not None:
            self._hashes[key] = h.checksum
        else:
            self._hashes.pop(key, None)

    def apply(self, key: Key, enc: codec.Encoded, *, where: str = "") -> torch.Tensor:
        """Consumer: validate ``enc`` against the stored version of ``key`` (a delta must be against exactly it),
        apply it with undo, check the producer's checksum; returns the held bytes. ``DeltaFormatError`` /
        ``DeltaMismatch`` leave the bytes as they were (a checksum failure after applying: call ``rollback``)."""
        dst = self._touch(key)
        at = where or f"chunk {key}"
        have = self._version[key]
        if enc.header.kind != codec.DENSE and have is None:
            raise DeltaMismatch(f"{at}: a {enc.header.kind} delta against version {enc.header.base}, but no version "
                                "is held")
        idx, vals = codec.validate(dst, enc, base=have, where=at)
        self._log(key, dst, idx)
        codec.apply_changes(dst, idx, vals)
        codec.verify(dst, enc.header, where=at)
        self._keep_hash(key, enc.header)
        return dst

    def _scratch_for(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """One buffer per working device, the size of the largest chunk, allocated on first use."""
        s = self._scratch.get(device)
        if s is None:
            s = self._scratch[device] = torch.empty(max(self.sizes.values(), default=0), dtype=torch.uint8,
                                                    device=device)
        return s[:nbytes]
