"""Chunk delta codec: a packed chunk's new bytes against the bytes last served for it, smallest of three forms.

A chunk (``plan/pack.py``) is one contiguous ``uint8`` tensor of mixed dtypes. The codec sees it as **words**: 16-bit
when its length is even (every slice starts at ``ALIGN`` = 64 bytes and every dtype the engine packs is 1, 2 or 4
bytes, so a chunk is even unless its last slice has an odd number of 1-byte elements), else bytes. A word "changed"
when any of its bits did; the codec is byte-exact whatever the words hold (bf16, fp32, fp8 pairs, int8).

Wire forms (``DeltaHeader.kind``; ``n`` words of ``w`` bytes, ``k`` changed, all little-endian):

- ``dense``  — the new bytes; ``count == n``.
- ``pairs``  — ``k`` int32 word indices, strictly increasing, then the ``k`` new word values; ``4k + wk`` bytes.
- ``bitmap`` — a bitmap of ``ceil(n / 32)`` little-endian uint32 (bit ``i % 32`` of word ``i // 32`` set for a
  changed word ``i``; bits past ``n`` zero), then the ``k`` new word values in word order; ``4 ceil(n / 32) + wk``.

Every section starts aligned to its element size when the payload does (indices and bitmap first).

**Choice rule**: the smallest payload; ties go to dense, then pairs (cheaper to apply). For bf16 words pairs win
below 1/32 (3.1 %) changed, the bitmap up to 15/16, dense above; no base (first sync, rejoiner) means dense. The
payload is never larger than the dense bytes; the header adds a few tens of bytes (``HEADER_MAX``).

Finding changed words reads both chunks once as 64-bit blocks and refines only the blocks that differ (one full
pass plus work proportional to the changes; plain torch, so the same code runs on CUDA). Everything is
deterministic: indices come out sorted, every write is to a distinct word.

A consumer trusts nothing: :func:`check_header` validates every header field against the chunk size its own plan
gives before anything is allocated, and :func:`decode_` validates the payload (length, index range and order, bitmap
population and padding) before it writes a byte; failures raise :class:`~shardsync.errors.DeltaFormatError` naming
the chunk and the field::

    enc = encode(new, old, base=4, checksum=True)        # producer: old = the bytes it served at version 4
    wire = header_bytes(enc.header); payload = enc.payload
    h = read_header(wire, nbytes=layout_chunk.nbytes, base=4, where="plan ab12 group model.layers.0 chunk 0")
    decode_(mirror, Encoded(h, payload), base=4)         # consumer: mirror holds its version-4 bytes
    verify(mirror, h)                                    # xxh3-64 of the bytes it now holds
    h5 = apply_verified(mirror, enc5, base=5, held_hash=h4)  # or both at once; a GPU chunk's word hash folded
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import torch

from ..errors import DeltaError, DeltaFormatError, DeltaMismatch
from ..kernels import word_delta
from ..kernels.word_hash import fold

__all__ = ["DENSE", "PAIRS", "BITMAP", "KINDS", "HEADER_MAX", "DeltaHeader", "Encoded", "encode", "dense",
           "decode_", "decode_into", "check_header", "header_bytes", "read_header", "payload_nbytes", "word_size",
           "choose", "checksum", "checksum_of", "hash_for", "XXH3", "WORD", "HASHES", "verify", "changed_words",
           "find_changes", "find_changes_many", "new_checksum", "encode_changes", "validate", "apply_changes",
           "apply_verified", "apply_verified_many"]

DENSE, PAIRS, BITMAP = "dense", "pairs", "bitmap"
KINDS = (DENSE, PAIRS, BITMAP)
_U64 = 1 << 64
DENSE_BLOCKS = 8
"""``changed_words`` compares words directly once more than 1 in this many 64-bit blocks differ."""


class DeltaHeader(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What travels before a chunk's payload (a msgpack array, ~20 bytes). Every field is checked by
    :func:`check_header`."""

    kind: str
    """``dense``, ``pairs`` or ``bitmap``."""
    nbytes: int
    """Length of the chunk (new and old alike), bytes; must equal what the consumer's plan says."""
    count: int
    """Words the payload carries: all ``n`` for dense, the changed ones otherwise."""
    base: int | None = None
    """Version of the bytes a pairs/bitmap payload applies to (the consumer must hold exactly it); None for dense."""
    checksum: int | None = None
    """The new dense bytes' checksum (by ``hash``), when the producer computed it."""
    hash: int = 0
    """Which checksum: ``XXH3`` (0, computed on the host) or ``WORD`` (1, ``kernels/word_hash.py``: computed where
    the chunk lies — a GPU chunk's, with no copy to the host)."""


XXH3, WORD = 0, 1
HASHES = (XXH3, WORD)
HEADER_MAX = len(msgspec.msgpack.encode(DeltaHeader(kind=BITMAP, nbytes=_U64 - 1, count=_U64 - 1, base=_U64 - 1,
                                                    checksum=_U64 - 1, hash=WORD)))
"""The largest encoded header, bytes (the bound on what a delta adds to a dense chunk)."""
_HEADER_DEC = msgspec.msgpack.Decoder(DeltaHeader)


@dataclass(frozen=True)
class Encoded:
    """One chunk on the wire: its header and payload (``uint8``, ``payload_nbytes(...)`` bytes). A dense payload
    may be the very tensor that was encoded (no copy) unless ``out`` was given."""

    header: DeltaHeader
    payload: torch.Tensor
    changed: int | None = None
    """Changed words found by the encoder (None when there was no base to compare with); not sent."""

    @property
    def wire_nbytes(self) -> int:
        """Payload plus header bytes."""
        return self.payload.numel() + len(header_bytes(self.header))


def word_size(nbytes: int) -> int:
    """2 for an even chunk, 1 for an odd one."""
    return 2 if nbytes % 2 == 0 else 1


def payload_nbytes(kind: str, nbytes: int, count: int) -> int:
    """Payload length of a chunk of ``nbytes`` in form ``kind`` carrying ``count`` words."""
    w = word_size(nbytes)
    if kind == DENSE:
        return nbytes
    if kind == PAIRS:
        return (4 + w) * count
    if kind == BITMAP:
        return w * count + 4 * math.ceil(nbytes // w / 32)
    raise DeltaFormatError(f"unknown delta kind {kind!r} (known: {', '.join(KINDS)})", field="kind")


def choose(nbytes: int, changed: int) -> str:
    """The choice rule: the smallest payload, ties to dense then pairs."""
    sizes = [(payload_nbytes(k, nbytes, changed), i, k) for i, k in enumerate(KINDS)]
    return min(sizes)[2]


def _words(t: torch.Tensor, w: int) -> torch.Tensor:
    """``t`` as words; an even chunk at an odd address is copied first (the engine's chunks are 64-byte aligned)."""
    if w == 1:
        return t
    return (t if t.storage_offset() % 2 == 0 else t.clone()).view(torch.int16)


def _check_chunk(t: torch.Tensor, what: str, where: str) -> None:
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise DeltaFormatError(f"{where or 'chunk'}: {what} must be a contiguous 1-D uint8 tensor, got "
                               f"{t.dtype} shape {list(t.shape)} contiguous={t.is_contiguous()}", field=what)


def changed_words(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted int64 indices of the words that differ, their new values as words). One pass over both chunks as
    64-bit blocks, then only the differing blocks are split into words; unaligned chunks fall back to words."""
    w = word_size(new.numel())
    nw, ow = _words(new, w), _words(old, w)
    lanes, shift = (4, 2) if w == 2 else (8, 3)
    blocks = new.numel() // 8
    if blocks and new.storage_offset() % 8 == 0 and old.storage_offset() % 8 == 0:
        n64, o64 = new[: blocks * 8].view(torch.int64), old[: blocks * 8].view(torch.int64)
        bidx = (n64 != o64).nonzero().view(-1)
        if bidx.numel() * DENSE_BLOCKS > blocks:  # changes everywhere: refining blocks costs more than words
            idx = (nw != ow).nonzero().view(-1)
            return idx, nw.index_select(0, idx)
        nb = n64.index_select(0, bidx)
        sub = nb.view(nw.dtype).ne(o64.index_select(0, bidx).view(nw.dtype)).nonzero().view(-1)
        idx = bidx.index_select(0, sub >> shift).bitwise_left_shift_(shift).bitwise_or_(sub & (lanes - 1))
        vals = nb.view(nw.dtype).index_select(0, sub)
        head = blocks * lanes
        if head == nw.numel():
            return idx, vals
        tail = (nw[head:] != ow[head:]).nonzero().view(-1)
        return torch.cat([idx, tail + head]), torch.cat([vals, nw[head:].index_select(0, tail)])
    idx = (nw != ow).nonzero().view(-1)
    return idx, nw.index_select(0, idx)


def find_changes(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """:func:`changed_words` and, for a chunk checksummed by the word hash (a GPU chunk) of whole aligned 64-bit
    words, the change of its word hash (``kernels/word_delta.py``: fused passes on CUDA, no pass over the chunk to
    hash it); else None for the hash change."""
    return find_changes_many([(new, old)])[0]


def find_changes_many(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor,
                                                                                  int | None]]:
    """:func:`find_changes` of every (new, old) pair: the word-hashed ones together (on CUDA one host sync for all
    of them), the others one by one."""
    fused = [i for i, (new, old) in enumerate(pairs) if hash_for(new) == WORD and word_delta.eligible(new, old)]
    out: list = [None] * len(pairs)
    for i, ch in zip(fused, word_delta.find_changes_many([pairs[i] for i in fused])):
        out[i] = (ch.idx, ch.vals, ch.hash_delta)
    for i, (new, old) in enumerate(pairs):
        if out[i] is None:
            out[i] = (*changed_words(new, old), None)
    return out


def _buffer(out: torch.Tensor | None, size: int, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(size, dtype=torch.uint8, device=like.device)
    _check_chunk(out, "out", "")
    if out.numel() < size:
        raise DeltaFormatError(f"output buffer of {out.numel()} bytes is smaller than the {size}-byte payload",
                               field="out")
    return out[:size]


def dense(new: torch.Tensor, *, out: torch.Tensor | None = None, checksum: bool | int = False) -> Encoded:
    """The dense form of ``new`` (no base needed)."""
    _check_chunk(new, "new", "")
    n = new.numel()
    payload = new if out is None else _buffer(out, n, new).copy_(new)
    csum, algo = _csum(new, checksum)
    return Encoded(DeltaHeader(kind=DENSE, nbytes=n, count=n // word_size(n), checksum=csum, hash=algo), payload)


def encode(new: torch.Tensor, old: torch.Tensor | None, *, base: int | None = None, out: torch.Tensor | None = None,
           checksum: bool | int = False, base_hash: int | None = None) -> Encoded:
    """The smallest form of ``new`` given ``old`` (the bytes served at version ``base``; None: dense).

    ``out``: where the payload goes (at least ``new.numel()`` bytes always suffices); else a new tensor (pairs,
    bitmap) or ``new`` itself (dense). On CUDA one host sync learns the number of changed words. ``base_hash``:
    ``old``'s word hash, when known — a GPU chunk's checksum is then folded from it and the changes (no pass)."""
    _check_chunk(new, "new", "")
    if old is None:
        return dense(new, out=out, checksum=checksum)
    _check_chunk(old, "old", "")
    n = new.numel()
    if old.numel() != n or old.device != new.device:
        raise DeltaFormatError(f"old chunk is {old.numel()} bytes on {old.device}, new is {n} bytes on {new.device}",
                               field="old")
    idx, vals, hdelta = find_changes(new, old)
    return encode_changes(new, idx, vals, base=base, out=out, checksum=checksum, base_hash=base_hash,
                          hash_delta=hdelta)


def encode_changes(new: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, *, base: int | None = None,
                   out: torch.Tensor | None = None, checksum: bool | int = False, base_hash: int | None = None,
                   hash_delta: int | None = None) -> Encoded:
    """:func:`encode` from :func:`find_changes`' output (for callers that keep the indices, e.g. an undo log).
    With ``checksum=True``, a word-hashed chunk, ``base_hash`` (the old bytes' word hash) and ``hash_delta``, the
    checksum is folded (``kernels.word_hash.fold``) instead of hashed."""
    n = new.numel()
    k = idx.numel()
    kind = choose(n, k)
    csum, algo = new_checksum(new, checksum, base_hash=base_hash, hash_delta=hash_delta)
    if kind == DENSE:
        enc = dense(new, out=out)
        return Encoded(DeltaHeader(kind=DENSE, nbytes=n, count=enc.header.count, checksum=csum, hash=algo),
                       enc.payload, k)
    buf = _buffer(out, payload_nbytes(kind, n, k), new)
    if kind == PAIRS:
        buf[: 4 * k].view(torch.int32).copy_(idx)
        buf[4 * k:].view(vals.dtype).copy_(vals)
    else:
        nb = payload_nbytes(BITMAP, n, 0)
        buf[nb:].view(vals.dtype).copy_(vals)
        bits = buf[:nb].view(torch.int32)
        bits.zero_()
        one = torch.ones((), dtype=torch.int32, device=new.device)
        bits.index_add_(0, idx >> 5, torch.bitwise_left_shift(one, (idx & 31).to(torch.int32)))  # distinct: + == |
    return Encoded(DeltaHeader(kind=kind, nbytes=n, count=k, base=base, checksum=csum, hash=algo), buf, k)


def header_bytes(h: DeltaHeader) -> bytes:
    """msgpack of the header (at most ``HEADER_MAX`` bytes)."""
    return msgspec.msgpack.encode(h)


def read_header(data: bytes | memoryview, *, nbytes: int, base: int | None = None, where: str = "") -> DeltaHeader:
    """Decode and :func:`check_header` a header received from a peer (``DeltaFormatError`` on anything wrong)."""
    if len(data) > HEADER_MAX:
        raise DeltaFormatError(f"{where or 'chunk'}: delta header of {len(data)} bytes exceeds {HEADER_MAX}",
                               field="header")
    try:
        h = _HEADER_DEC.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DeltaFormatError(f"{where or 'chunk'}: malformed delta header: {e}", field="header") from None
    check_header(h, nbytes=nbytes, base=base, where=where)
    return h


def check_header(h: DeltaHeader, *, nbytes: int, base: int | None = None, where: str = "") -> int:
    """Validate every field against what the consumer knows (``nbytes`` from its plan; ``base``: the version it
    holds, None to skip that check); returns the payload length to expect. Nothing is allocated from a header
    that fails here, and a passing one bounds the payload by ``nbytes``."""
    at = where or "chunk"

    def bad(field: str, msg: str) -> DeltaFormatError:
        return DeltaFormatError(f"{at}: delta header {field} {msg}", field=field)

    if not isinstance(h, DeltaHeader):
        raise DeltaFormatError(f"{at}: expected a DeltaHeader, got {type(h).__name__}", field="header")
    for f in ("nbytes", "count"):
        if type(getattr(h, f)) is not int:
            raise bad(f, f"is {type(getattr(h, f)).__name__}, not int")
    for f in ("base", "checksum"):
        v = getattr(h, f)
        if v is not None and (type(v) is not int or not 0 <= v < _U64):
            raise bad(f, f"= {v!r} is not None or an unsigned 64-bit int")
    if type(h.hash) is not int or h.hash not in HASHES:
        raise bad("hash", f"= {h.hash!r} is not one of {HASHES}")
    if h.kind not in KINDS:
        raise bad("kind", f"{h.kind!r} is not one of {', '.join(KINDS)}")
    if h.nbytes != nbytes:
        raise bad("nbytes", f"= {h.nbytes}, but the plan's chunk is {nbytes} bytes")
    words = nbytes // word_size(nbytes)
    if h.kind == DENSE and h.count != words:
        raise bad("count", f"= {h.count} for a dense chunk of {words} words")
    if not 0 <= h.count <= words:
        raise bad("count", f"= {h.count} outside 0..{words} (the chunk's words)")
    size = payload_nbytes(h.kind, nbytes, h.count)
    if size > nbytes:
        raise bad("count", f"= {h.count} gives a {h.kind} payload of {size} bytes, more than the dense {nbytes}")
    if h.kind != DENSE:
        if h.base is None:
            raise bad("base", f"missing: a {h.kind} delta must name the version it applies to")
        if base is not None and h.base != base:
            raise DeltaMismatch(f"{at}: delta against version {h.base}, but this side holds version {base}")
    return size


def _typed(payload: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    part = payload[lo:hi]
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()  # an unaligned receive buffer: a copy of at most the validated payload
    return part.view(dtype)


def _pairs(payload: torch.Tensor, k: int, size: int, wdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A pairs payload's int32 indices and its values (words of ``wdt``); nothing checked."""
    return _typed(payload, 0, 4 * k, torch.int32), _typed(payload, 4 * k, size, wdt)


def _checked_payload(dst: torch.Tensor, enc: Encoded, base: int | None, at: str) -> int:
    """The header against ``dst`` and the version held, the payload's length and device; returns its size."""
    _check_chunk(dst, "dst", at)
    h, payload = enc.header, enc.payload
    size = check_header(h, nbytes=dst.numel(), base=base, where=at)
    _check_chunk(payload, "payload", at)
    if payload.numel() != size:
        raise DeltaFormatError(f"{at}: {h.kind} payload is {payload.numel()} bytes, the header implies {size}",
                               field="payload")
    if payload.device != dst.device:
        raise DeltaFormatError(f"{at}: payload on {payload.device}, destination on {dst.device}", field="payload")
    return size


def validate(dst: torch.Tensor, enc: Encoded, base: int | None = None, where: str = "") -> tuple[torch.Tensor | None, torch.Tensor]:
    """Validate ``enc`` (header and payload) for applying to ``dst`` without writing anything; returns (sorted
    int64 word indices, or None for dense; the values to write there)."""
    at = where or "chunk"
    h, payload = enc.header, enc.payload
    size = _checked_payload(dst, enc, base, at)
    if h.kind == DENSE:
        return None, payload
    w, n, k = word_size(h.nbytes), h.nbytes // word_size(h.nbytes), h.count
    wdt = torch.int16 if w == 2 else torch.uint8
    if h.kind == PAIRS:
        idx, vals = _pairs(payload, k, size, wdt)
        idx = idx.long()
        if k and (int(idx[0]) < 0 or int(idx[-1]) >= n or (k > 1 and not bool((idx[1:] > idx[:-1]).all()))):
            raise DeltaFormatError(f"{at}: pairs indices must be strictly increasing within 0..{n - 1}",
                                   field="indices")
        return idx, vals
    nb = payload_nbytes(BITMAP, h.nbytes, 0)
    vals = _typed(payload, nb, size, wdt)
    bits = payload[:nb]
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    mask = bits.view(-1, 1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1)
    if bool(mask[n:].any()):
        raise DeltaFormatError(f"{at}: bitmap has bits set past the chunk's {n} words", field="bitmap")
    idx = mask[:n].nonzero().view(-1)
    if idx.numel() != k:
        raise DeltaFormatError(f"{at}: bitmap marks {idx.numel()} words, the header says count {k}", field="count")
    return idx, vals


def apply_changes(dst: torch.Tensor, idx: torch.Tensor | None, vals: torch.Tensor) -> None:
    """Write ``vals`` at word indices ``idx`` of ``dst`` (all of it when ``idx`` is None); no checks."""
    if idx is None:
        dst.copy_(vals)
    elif idx.numel():
        words = _words(dst, word_size(dst.numel()))
        words.index_copy_(0, idx, vals)
        if words.data_ptr() != dst.data_ptr():  # an unaligned destination was worked on in a copy
            dst.copy_(words.view(torch.uint8))


def decode_(dst: torch.Tensor, enc: Encoded, *, base: int | None = None, where: str = "") -> torch.Tensor:
    """Apply ``enc`` in place to ``dst`` (``uint8``, the chunk's bytes at version ``enc.header.base``); ``base``:
    the version ``dst`` holds (checked against the header when given). Validates everything before writing."""
    idx, vals = validate(dst, enc, base, where)
    apply_changes(dst, idx, vals)
    return dst


def decode_into(out: torch.Tensor, old: torch.Tensor, enc: Encoded, *, base: int | None = None,
                where: str = "") -> torch.Tensor:
    """Write the new bytes into ``out`` — where a dense pull of the chunk would land (a receive slot) — from
    ``old`` (the held bytes, left as they are) and ``enc``; the slot then unpacks exactly as after a dense pull."""
    idx, vals = validate(out, enc, base, where)
    if idx is not None:
        _check_chunk(old, "old", where or "chunk")
        if old.numel() != out.numel() or old.device != out.device:
            raise DeltaFormatError(f"{where or 'chunk'}: held bytes are {old.numel()} on {old.device}, the "
                                   f"destination {out.numel()} on {out.device}", field="old")
        if old.data_ptr() != out.data_ptr():
            out.copy_(old)
    apply_changes(out, idx, vals)
    return out


def apply_verified(dst: torch.Tensor, enc: Encoded, *, base: int | None = None, held_hash: int | None = None,
                   where: str = "") -> int | None:
    """Consumer: :func:`decode_` then :func:`verify`; returns the checksum ``dst`` now has (the header's, None
    without one). ``held_hash``: the word hash of ``dst``'s bytes before (verified when they were written) — for a
    word-hashed delta on whole aligned 64-bit words the check then costs work proportional to the changes and runs
    before anything is written: what the delta would do to the terms of the 64-bit words it touches folds the held
    hash into the one the bytes would have, which must be the header's (a pairs payload's order and range are
    checked in the same kernel). Raises as ``decode_`` / ``verify``; after a ``DeltaMismatch`` from the full check
    (no held hash) ``dst`` holds the wrong bytes (read it dense), after one from the fold it is untouched."""
    got = apply_verified_many([(dst, enc, base, held_hash, where)])[0]
    if isinstance(got, DeltaError):
        raise got
    return got


def apply_verified_many(items: list[tuple[torch.Tensor, Encoded, int | None, int | None, str]]
                        ) -> list[int | None | DeltaError]:
    """:func:`apply_verified` of every ``(dst, enc, base, held_hash, where)`` (a group's chunks): the fused checks
    of all of them queued before one host sync. Per item, the checksum its ``dst`` now has, or the ``DeltaError``
    it raised (nothing written where the fused check refused it; each item stands alone)."""
    out: list[int | None | DeltaError] = [None] * len(items)
    fused = []
    for i, (dst, enc, base, held_hash, where) in enumerate(items):
        h = enc.header
        try:
            if not (h.kind != DENSE and h.hash == WORD and h.checksum is not None and held_hash is not None
                    and word_delta.eligible(dst)):
                decode_(dst, enc, base=base, where=where)
                verify(dst, h, where=where)
                out[i] = h.checksum
                continue
            if h.kind == PAIRS:
                idx, vals = _pairs(enc.payload, h.count, _checked_payload(dst, enc, base, where or "chunk"),
                                   torch.int16)
            else:
                idx, vals = validate(dst, enc, base, where)
        except DeltaError as e:
            out[i] = e
            continue
        fused.append((i, idx, vals))
    terms = word_delta.change_terms_many([(items[i][0], idx, vals) for i, idx, vals in fused])
    for (i, idx, vals), (ok, change) in zip(fused, terms):
        dst, enc, _, held_hash, where = items[i]
        h, at = enc.header, where or "chunk"
        if not ok:
            out[i] = DeltaFormatError(f"{at}: pairs indices must be strictly increasing within "
                                      f"0..{dst.numel() // 2 - 1}", field="indices")
        elif fold(held_hash, dst.numel(), change) != h.checksum:  # checked before a byte is written
            out[i] = DeltaMismatch(f"{at}: the {h.kind} delta applied to the held bytes would not match the "
                                   f"producer's checksum {h.checksum:#018x}; nothing was written")
        else:
            apply_changes(dst, idx.long(), vals)
            out[i] = h.checksum
    return out


def new_checksum(new: torch.Tensor, checksum: bool | int, *, base_hash: int | None = None,
                 hash_delta: int | None = None) -> tuple[int | None, int]:
    """The header's checksum of ``new`` and its hash, as for :func:`encode_changes`: folded from the base's word
    hash and the changes' (no pass over the chunk) where both are known, else as ``_csum``."""
    if checksum is True and base_hash is not None and hash_delta is not None and hash_for(new) == WORD:
        return fold(base_hash, new.numel(), hash_delta), WORD
    return _csum(new, checksum)


def _csum(new: torch.Tensor, checksum: bool | int) -> tuple[int | None, int]:
    """The header's checksum and its hash: ``True`` hashes ``new`` (:func:`hash_for` its device); an int is its
    xxh3-64, already computed by the caller (a producer that checksums the chunk anyway); ``False``: none."""
    if checksum is True:
        algo = hash_for(new)
        return checksum_of(new, algo), algo
    return (None if checksum is False or checksum is None else int(checksum)), XXH3


def hash_for(t: torch.Tensor) -> int:
    """The checksum a producer computes for a chunk on ``t``'s device: ``WORD`` on a GPU (no host copy), ``XXH3`` on
    the host (the faster one there)."""
    return WORD if t.device.type != "cpu" else XXH3


def _sum(t: torch.Tensor) -> int:
    import xxhash

    if t.device.type != "cpu":
        t = t.cpu()
    return xxhash.xxh3_64_intdigest(memoryview(t.numpy()))


def checksum_of(data: torch.Tensor, algo: int) -> int:
    """``data``'s checksum by hash ``algo`` (``XXH3``: the same function as ``engine.wire.chunk_checksum``, a device
    chunk copied to the host for it; ``WORD``: ``kernels.word_hash``, computed on the chunk's device)."""
    _check_chunk(data, "data", "")
    if algo == WORD:
        from ..kernels.word_hash import word_hash

        return word_hash(data)
    if algo != XXH3:
        raise DeltaFormatError(f"unknown checksum hash {algo!r} (known: {HASHES})", field="hash")
    return _sum(data)


def checksum(data: torch.Tensor) -> int:
    """xxh3-64 of a contiguous uint8 chunk (the same function as ``engine.wire.chunk_checksum``; a device chunk
    is copied to the host for it)."""
    return checksum_of(data, XXH3)


def verify(held: torch.Tensor, h: DeltaHeader, *, where: str = "") -> None:
    """After applying: ``DeltaMismatch`` unless ``held`` hashes to the header's checksum (no checksum: no check)."""
    if h.checksum is not None and checksum_of(held, h.hash) != h.checksum:
        raise DeltaMismatch(f"{where or 'chunk'}: bytes after applying the {h.kind} delta do not match the "
                            f"producer's checksum {h.checksum:#018x}")
