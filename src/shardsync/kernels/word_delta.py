"""The changed 16-bit words of a chunk against its base, and what they do to its word hash, without a full pass.

The delta codec (``delta/codec.py``) needs, per chunk, the sorted indices and new values of the 16-bit words that
changed, and both sides need the new bytes' checksum. With the word hash (``kernels/word_hash.py``: a sum of one
term per 64-bit word) the checksum of the new bytes is the base's plus, for each 64-bit word holding a change,
``term(new word) - term(old word)`` — work proportional to the changes, not to the chunk (:func:`fold` turns a hash
and that sum into the new hash). So:

- :func:`find_changes` (producer): on CUDA two fused Triton passes — over the new and old chunk, per block of
  words the count of changed words, the hash terms' change and a byte per 64-bit word flagging its changed 16-bit
  words; then, after one host sync for the totals (of all a group's chunks: :func:`find_changes_many`), from the
  flags the compacted indices and values at each block's offset (the old chunk is not read again, the new one only
  in the sectors holding a change, a block without changes not at all) —
  instead of torch's compare / nonzero / refine / gather passes and a hash of the whole chunk. Elsewhere (CPU,
  an odd or unaligned chunk) the same results from torch ops.
- :func:`change_terms` (consumer): what writing a delta's values at its indices would do to the terms of the
  64-bit words they touch, checking on the way that the indices are strictly increasing and in range — one kernel,
  one host sync, nothing written: the held hash folded by it must be the producer's checksum before a byte of the
  delta is applied.

Every result is the definition's: the Triton and torch paths agree bit for bit (checked once per device against
each other before the kernels are used, as for the word hash) and the tests check both against ``word_hash``::

    ch = find_changes(new, old)                       # idx (int64, sorted), vals (int16), hash_delta
    h_new = fold(h_old, new.numel(), ch.hash_delta)   # == word_hash(new) when h_old == word_hash(old)
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from .word_hash import C1, C2, G, fold, mix_terms
from .word_hash import warm as word_hash_warm

__all__ = ["Changes", "find_changes", "find_changes_many", "change_terms", "change_terms_many", "warm", "fold",
           "eligible", "terms_torch"]

log = logging.getLogger(__name__)

BLOCK64 = 1024
"""64-bit words per program of the count pass (its compact pass takes the same bytes as 4x as many 16-bit words)."""
TERM_BLOCK = 1024
"""Indices per program of :func:`change_terms`."""
_M = (1 << 64) - 1


@dataclass(frozen=True)
class Changes:
    """What changed in a chunk: sorted 16-bit word indices (int64), their new values (int16) and the word hash's
    change (mod 2^64; :func:`fold`)."""

    idx: torch.Tensor
    vals: torch.Tensor
    hash_delta: int


def eligible(*ts: torch.Tensor) -> bool:
    """Whether chunks go through the fused paths: 1-D uint8, a whole number of 64-bit words, 8-byte aligned, fewer
    than 2^31 16-bit words (the pairs form's index range), all on one device."""
    dev = ts[0].device
    return all(t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous() and t.device == dev
               and t.numel() % 8 == 0 and t.data_ptr() % 8 == 0 and t.numel() // 2 < 1 << 31 for t in ts)


# ------------------------------------------------------------------------------------------------ torch reference
def _first_of_word(p: torch.Tensor) -> torch.Tensor:
    """For sorted 64-bit word positions ``p`` (one per changed 16-bit word): whether each is the first of its word."""
    first = torch.ones_like(p, dtype=torch.bool)
    first[1:] = p[1:] != p[:-1]
    return first


def terms_torch(chunk: torch.Tensor, idx: torch.Tensor) -> int:
    """Sum of the terms of the distinct 64-bit words of ``chunk`` (uint8, ``eligible``) holding the sorted 16-bit
    word indices ``idx`` (no checks)."""
    if not idx.numel():
        return 0
    p = idx.long() >> 2
    first = _first_of_word(p)
    t = mix_terms(chunk.view(torch.int64).index_select(0, p), p + 1)
    return int(torch.where(first, t, torch.zeros_like(t)).sum()) & _M


def _changes_torch(new: torch.Tensor, old: torch.Tensor) -> Changes:
    a, b = new.view(torch.int16), old.view(torch.int16)
    idx = (a != b).nonzero().view(-1)
    return Changes(idx, a.index_select(0, idx), (terms_torch(new, idx) - terms_torch(old, idx)) & _M)


def _change_torch(chunk: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> tuple[bool, int]:
    n16 = chunk.numel() // 2
    if not idx.numel():
        return True, 0
    i = idx.long()
    ok = bool(((i[0] >= 0) & (i[-1] < n16) & ((i[1:] > i[:-1]).all() if i.numel() > 1 else True)).item())
    if not ok:
        return False, 0
    p = i >> 2
    first = _first_of_word(p)
    words = p[first]
    old = chunk.view(torch.int64).index_select(0, words)
    new = old.clone()
    rank = first.long().cumsum(0) - 1  # which touched word each change lies in
    new.view(torch.int16).index_copy_(0, rank * 4 + (i & 3), vals.view(torch.int16))
    return True, int((mix_terms(new, words + 1) - mix_terms(old, words + 1)).sum()) & _M


# ------------------------------------------------------------------------------------------------ Triton
_ok: dict[str, bool] = {}
why_not: dict[str, str] = {}
"""Per device, why the kernels are not used there (a build error, a disagreement with torch)."""
_lock = threading.Lock()


def _triton():
    from . import word_triton as k  # imports triton: only where the kernels may run

    return k.count, k.compact, k.change


def _changes_triton(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Changes]:
    """Every chunk's count pass queued, then one host sync for all their totals, then their compact passes."""
    count, compact, _ = _triton()
    queued, totals = [], []
    for new, old in pairs:
        n64 = new.numel() // 8
        blocks = -(-n64 // BLOCK64)
        counts = torch.empty(blocks, dtype=torch.int64, device=new.device)
        hsum = torch.empty(blocks, dtype=torch.int64, device=new.device)
        starts = torch.zeros(blocks + 1, dtype=torch.int64, device=new.device)  # exclusive; the last is the total
        flags = torch.empty(n64, dtype=torch.uint8, device=new.device)  # per 64-bit word: its changed 16-bit words
        if blocks:
            count[(blocks,)](new.view(torch.int64), old.view(torch.int64), counts, hsum, flags, n64, G, C1, C2,
                             BLOCK=BLOCK64, num_warps=8)
            starts[1:] = counts.cumsum(0)
        totals += [starts[-1:], hsum.sum().view(1)]
        queued.append((new, flags, blocks, counts, starts))
    flat = torch.cat(totals).tolist() if totals else []
    out = []
    for (new, flags, blocks, counts, starts), k, hdelta in zip(queued, flat[0::2], flat[1::2]):
        idx = torch.empty(k, dtype=torch.int64, device=new.device)
        vals = torch.empty(k, dtype=torch.int16, device=new.device)
        if k:
            compact[(blocks,)](new.view(torch.int16), flags, starts, counts, idx, vals, new.numel() // 2,
                               BLOCK=4 * BLOCK64, num_warps=8)
        out.append(Changes(idx, vals, hdelta & _M))
    return out


def _change_triton(chunk: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> tuple[bool, int]:
    return _changes_terms_triton([(chunk, idx, vals)])[0]


def _changes_terms_triton(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[tuple[bool, int]]:
    """Every chunk's check queued, then one host sync for all their results."""
    _, _, change = _triton()
    sums = []
    for chunk, idx, vals in items:
        k = idx.numel()
        if not k:
            continue
        blocks = -(-k // TERM_BLOCK)
        hsum = torch.empty(blocks, dtype=torch.int64, device=chunk.device)
        bad = torch.empty(blocks, dtype=torch.int32, device=chunk.device)
        change[(blocks,)](chunk.view(torch.int64), idx, vals.view(torch.int16), k, chunk.numel() // 2, hsum, bad, G,
                          C1, C2, BLOCK=TERM_BLOCK, num_warps=4)
        sums += [bad.sum().long().view(1), hsum.sum().view(1)]
    flat = iter(torch.cat(sums).tolist() if sums else [])
    out = []
    for _, idx, _ in items:
        if not idx.numel():
            out.append((True, 0))
            continue
        nbad, total = next(flat), next(flat)
        out.append((nbad == 0, int(total) & _M if nbad == 0 else 0))
    return out


def _use_triton(device: torch.device) -> bool:
    """Whether the kernels run on this device: CUDA, built, and equal to the torch path on a probe (checked once)."""
    if device.type != "cuda":
        return False
    key = str(device)
    with _lock:
        if key not in _ok:
            try:
                g = torch.Generator(device="cpu").manual_seed(7)
                old = torch.randint(0, 256, (3 * 8 * BLOCK64 + 64,), dtype=torch.uint8, generator=g)
                new = old.clone()
                new[torch.randint(0, new.numel(), (300,), generator=g)] ^= 1
                new, old = new.to(device), old.to(device)
                a, b = _changes_triton([(new, old)])[0], _changes_torch(new, old)
                want = _change_torch(old, b.idx, b.vals)
                same = (torch.equal(a.idx, b.idx) and torch.equal(a.vals, b.vals) and a.hash_delta == b.hash_delta
                        and _change_triton(old, a.idx, a.vals) == want  # a history's int64 indices, and a
                        and _change_triton(old, a.idx.to(torch.int32), a.vals) == want)  # pairs payload's int32
                _ok[key] = bool(same)
                if not same:
                    why_not[key] = "the kernels disagree with torch on a probe"
            except Exception as e:  # no triton, no compiler: the torch path
                why_not[key] = f"{type(e).__name__}: {e}"
                _ok[key] = False
            if not _ok[key]:
                log.warning("word_delta: the Triton kernels are not used on %s (%s): torch ops instead", device,
                            why_not[key][:500])
        return _ok[key]


def warm(device: torch.device | str) -> bool:
    """Check (and so compile) the kernels here and the word hash's on ``device`` now — at init, not in the first sync
    that needs them; whether they are used there (else the torch paths)."""
    device = torch.device(device)
    return word_hash_warm(device) & _use_triton(device)  # both checked, whatever the first says


def find_changes(new: torch.Tensor, old: torch.Tensor) -> Changes:
    """The changed 16-bit words of ``new`` against ``old`` and the word hash's change (both ``eligible``)."""
    return find_changes_many([(new, old)])[0]


def find_changes_many(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Changes]:
    """:func:`find_changes` of every (new, old) pair, on CUDA with one host sync for all of them (a group's chunks:
    every count pass is queued before the one sync that learns their totals)."""
    for new, old in pairs:
        if not eligible(new, old) or new.numel() != old.numel():
            raise ValueError(f"find_changes takes two equal-sized eligible uint8 chunks, got {new.numel()} / "
                             f"{old.numel()} bytes on {new.device} / {old.device}")
    if pairs and _use_triton(pairs[0][0].device) and all(n.device == pairs[0][0].device for n, _ in pairs):
        return _changes_triton(pairs)
    return [_changes_torch(new, old) for new, old in pairs]


def change_terms(chunk: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> tuple[bool, int]:
    """(whether ``idx`` — 16-bit word indices, int32 or int64 — is strictly increasing within the chunk's words;
    the change of the word hash's terms were ``vals`` (16-bit, one per index) written there, 0 when not). Nothing is
    written: ``fold(hash, n, change)`` is the hash the chunk would have."""
    return change_terms_many([(chunk, idx, vals)])[0]


def change_terms_many(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[tuple[bool, int]]:
    """:func:`change_terms` of every ``(chunk, idx, vals)``, on CUDA with one host sync for all of them."""
    for chunk, idx, vals in items:
        if not eligible(chunk):
            raise ValueError(f"change_terms takes an eligible uint8 chunk, got {chunk.numel()} bytes at "
                             f"{chunk.data_ptr():#x}")
        if idx.device != chunk.device or vals.device != chunk.device or vals.numel() != idx.numel() \
                or vals.element_size() != 2:
            raise ValueError(f"indices ({idx.numel()} on {idx.device}) and 16-bit values ({vals.numel()} {vals.dtype} "
                             f"on {vals.device}) for a chunk on {chunk.device}")
    if items and _use_triton(items[0][0].device) and all(c.device == items[0][0].device for c, _, _ in items):
        return _changes_terms_triton(items)
    return [_change_torch(chunk, idx, vals) for chunk, idx, vals in items]
