"""The Triton kernels of the word hash (``kernels/word_hash.py``) and of the changed-word passes
(``kernels/word_delta.py``); imported only where they may run (it imports triton). One mixing function, ``_mixed``,
serves all of them: a 64-bit word's hash term at its 1-based position.

``terms``: per block of 64-bit words, the sum of their hash terms; ``count``: per block, the changed 16-bit words and
the hash terms' change, and per 64-bit word a byte flagging which of its four 16-bit words changed; ``compact``: from
those flags (the old chunk is not read again, the new one only where a change lies), the changed words' indices and
new values at each block's offset; ``change``:
what writing values at a sorted index list would do to the terms of the 64-bit words it touches (nothing is written),
and how many indices break the order or the range. Their contract is the torch path of each module.

Sizes (and the delta's index and value pointers, which a received payload places anywhere) are not specialized on:
one compiled variant per kernel and device serves every chunk, so the probe that checks the kernels at init
(``word_delta.warm``) also compiles all of them, and no sync waits for a compile.
"""

import triton
import triton.language as tl


@triton.jit
def _mixed(w, pos1, g, c1, c2):
    x = (w ^ (pos1.to(tl.uint64) * g)) * c1
    x = x ^ (x >> 32)
    x = x * c2
    return x ^ (x >> 29)


@triton.jit(do_not_specialize=["nwords"])
def terms(w_ptr, out_ptr, nwords, g, c1, c2, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < nwords
    w = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.uint64, bitcast=True)
    x = tl.where(mask, _mixed(w, offs + 1, g, c1, c2), tl.zeros_like(w))
    tl.store(out_ptr + pid, tl.sum(x, axis=0).to(tl.int64, bitcast=True))


@triton.jit(do_not_specialize=["n64"])
def count(new_ptr, old_ptr, counts_ptr, hsum_ptr, flags_ptr, n64, g, c1, c2, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n64
    a = tl.load(new_ptr + offs, mask=m, other=0).to(tl.uint64, bitcast=True)
    b = tl.load(old_ptr + offs, mask=m, other=0).to(tl.uint64, bitcast=True)
    x = a ^ b
    f0 = ((x & 0xFFFF) != 0).to(tl.int32)
    f1 = (((x >> 16) & 0xFFFF) != 0).to(tl.int32)
    f2 = (((x >> 32) & 0xFFFF) != 0).to(tl.int32)
    f3 = ((x >> 48) != 0).to(tl.int32)
    tl.store(flags_ptr + offs, (f0 | (f1 << 1) | (f2 << 2) | (f3 << 3)).to(tl.uint8), mask=m)
    tl.store(counts_ptr + pid, tl.sum(f0 + f1 + f2 + f3, axis=0).to(tl.int64))
    d = _mixed(a, offs + 1, g, c1, c2) - _mixed(b, offs + 1, g, c1, c2)
    d = tl.where(x != 0, d, tl.zeros_like(d))
    tl.store(hsum_ptr + pid, tl.sum(d, axis=0).to(tl.int64, bitcast=True))


@triton.jit(do_not_specialize=["n16"])
def compact(new_ptr, flags_ptr, starts_ptr, counts_ptr, idx_ptr, val_ptr, n16, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lim = tl.where(tl.load(counts_ptr + pid) > 0, n16, 0)
    m = offs < lim  # a block without changes loads nothing
    f = tl.load(flags_ptr + (offs >> 2), mask=m, other=0).to(tl.int32)  # count's flags: which 16-bit words changed
    ch = (((f >> (offs & 3).to(tl.int32)) & 1) != 0) & m
    a = tl.load(new_ptr + offs, mask=ch, other=0)  # only the sectors holding a change are read
    c = ch.to(tl.int32)
    at = tl.load(starts_ptr + pid) + (tl.cumsum(c, axis=0) - c).to(tl.int64)
    tl.store(idx_ptr + at, offs, mask=ch)
    tl.store(val_ptr + at, a, mask=ch)


@triton.jit(do_not_specialize=["idx_ptr", "val_ptr", "k", "n16"])
def change(words_ptr, idx_ptr, val_ptr, k, n16, hsum_ptr, bad_ptr, g, c1, c2, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    i = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
    prev = tl.load(idx_ptr + offs - 1, mask=m & (offs > 0), other=-1).to(tl.int64)
    bad = m & ((i < 0) | (i >= n16) | (i <= prev))
    good = m & ~bad
    p = i >> 2
    first = good & ((prev < 0) | ((prev >> 2) != p))  # the first change of its 64-bit word
    w = tl.load(words_ptr + p, mask=first, other=0).to(tl.uint64, bitcast=True)
    nw = w
    for j in tl.static_range(4):  # the word's changes are this one and the next (at most 3 more, in order)
        mj = first & (offs + j < k)
        ij = tl.load(idx_ptr + offs + j, mask=mj, other=0).to(tl.int64)
        vj = tl.load(val_ptr + offs + j, mask=mj, other=0).to(tl.uint16, bitcast=True).to(tl.uint64)
        same = mj & ((ij >> 2) == p)
        sh = ((ij & 3) * 16).to(tl.uint64)
        nw = tl.where(same, (nw & ~(tl.full(nw.shape, 0xFFFF, tl.uint64) << sh)) | (vj << sh), nw)
    t = _mixed(nw, p + 1, g, c1, c2) - _mixed(w, p + 1, g, c1, c2)
    t = tl.where(first, t, tl.zeros_like(t))
    tl.store(hsum_ptr + pid, tl.sum(t, axis=0).to(tl.int64, bitcast=True))
    tl.store(bad_ptr + pid, tl.sum(bad.to(tl.int32), axis=0))
