"""A 64-bit chunk checksum computed where the chunk lies: one pass over a GPU chunk, no copy to the host.

The delta codec checks every reconstructed chunk against the producer's checksum (``delta/codec.py``). xxh3 runs on
the host only, so a GPU chunk would first be copied there — on one H200 that copy and hash were nearly all of a delta
sync. :func:`word_hash` is defined on 64-bit words with wrapping integer arithmetic, so it has one value whatever the
device (a GPU producer and a CPU consumer agree), and on CUDA it is one fused Triton kernel reading each byte once.

Definition (all arithmetic mod 2^64; ``n`` bytes; ``b = n // 8`` little-endian words ``w_1..w_b``, then the last
``n % 8`` bytes zero-padded into word ``w_{b+1}`` when there are any)::

    x_i = w_i ^ (i * G);  x_i *= C1;  x_i ^= x_i >> 32;  x_i *= C2;  x_i ^= x_i >> 29     (>> logical)
    h   = fmix64(sum_i x_i ^ (n * C3))

Each word is mixed with its position (a moved or swapped word changes the sum) through an invertible map (any
single changed word changes its term), then summed — so blocks can be hashed in parallel and added. It catches
accidents (a torn or misplaced copy, a stale buffer), not an attacker: ``mac`` is for that (``security/``).

    h = word_hash(chunk)          # chunk: contiguous 1-D uint8, on any device
"""

from __future__ import annotations

import logging
import threading

import torch

__all__ = ["word_hash", "word_hash_many", "warm", "word_hash_reference", "mix_terms", "fold", "G", "C1", "C2", "C3"]

log = logging.getLogger(__name__)

_M = (1 << 64) - 1
G, C1, C2, C3 = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0xD6E8FEB86659FD93
_PIECE_WORDS = 1 << 20
"""The torch path hashes this many words at a time (its temporaries stay at 16 MiB whatever the chunk)."""
_BLOCK = 4096


def _s64(x: int) -> int:
    x &= _M
    return x - (1 << 64) if x >> 63 else x


def _fmix(h: int) -> int:
    h ^= h >> 33
    h = (h * C1) & _M
    h ^= h >> 33
    h = (h * C2) & _M
    return h ^ (h >> 33)


def _finish(total: int, n: int) -> int:
    return _fmix((total & _M) ^ ((n * C3) & _M))


_C1_INV, _C2_INV = pow(C1, -1, 1 << 64), pow(C2, -1, 1 << 64)


def _unfmix(h: int) -> int:
    h ^= h >> 33  # a shift of at least half the width: its own inverse
    h = (h * _C2_INV) & _M
    h ^= h >> 33
    h = (h * _C1_INV) & _M
    return h ^ (h >> 33)


def fold(h: int, nbytes: int, delta: int) -> int:
    """The hash of a chunk of ``nbytes`` whose hash was ``h`` once its terms changed by ``delta`` (mod 2^64: the
    sum over changed 64-bit words of the new term less the old, :func:`mix_terms`) — no pass over the chunk."""
    total = _unfmix(h & _M) ^ ((nbytes * C3) & _M)
    return _finish(total + delta, nbytes)


def _check(t: torch.Tensor) -> None:
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"word_hash takes a contiguous 1-D uint8 tensor, got {t.dtype} shape {list(t.shape)} "
                         f"contiguous={t.is_contiguous()}")


def word_hash_reference(data: bytes) -> int:
    """The definition in plain Python (slow; for tests)."""
    n = len(data)
    padded = data + bytes(-n % 8)
    total = 0
    for i in range(len(padded) // 8):
        x = int.from_bytes(padded[8 * i: 8 * i + 8], "little") ^ (((i + 1) * G) & _M)
        x = (x * C1) & _M
        x ^= x >> 32
        x = (x * C2) & _M
        x ^= x >> 29
        total += x
    return _finish(total, n)


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # torch shifts int64 arithmetically


def mix_terms(w: torch.Tensor, pos1: torch.Tensor) -> torch.Tensor:
    """The terms of int64 words ``w`` at 1-based word positions ``pos1`` (int64), wrapping (the definition's x_i)."""
    x = pos1.mul(_s64(G)).bitwise_xor_(w).mul_(_s64(C1))
    x.bitwise_xor_(_lsr(x, 32)).mul_(_s64(C2))
    return x.bitwise_xor_(_lsr(x, 29))


def _terms_sum(w: torch.Tensor, first: int) -> int:
    """Sum (mod 2^64) of the mixed terms of words ``w`` (int64), the first at position ``first`` (1-based)."""
    pos = torch.arange(first, first + w.numel(), dtype=torch.int64, device=w.device)
    return int(mix_terms(w, pos).sum()) & _M


def _words_torch(words: torch.Tensor) -> int:
    total = 0
    for s in range(0, words.numel(), _PIECE_WORDS):
        total += _terms_sum(words[s: s + _PIECE_WORDS], s + 1)
    return total


_kernel_ok: dict[int, bool] = {}
_lock = threading.Lock()


def _triton():
    from .word_triton import terms  # imports triton: only where the kernel may run

    return terms


def _words_triton(words: torch.Tensor) -> int:
    blocks = -(-words.numel() // _BLOCK)
    out = torch.empty(blocks, dtype=torch.int64, device=words.device)
    _triton()[(blocks,)](words, out, words.numel(), G, C1, C2, BLOCK=_BLOCK, num_warps=8)
    return int(out.sum()) & _M


def _use_triton(device: torch.device) -> bool:
    """Whether the fused kernel runs on this CUDA device: checked once against the torch path (a toolchain that
    cannot build it, or gets another value, leaves the torch path in use; both give the definition's value)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if idx not in _kernel_ok:
            try:
                probe = torch.randint(-(1 << 62), 1 << 62, (3 * _BLOCK + 5,), dtype=torch.int64, device=device)
                _kernel_ok[idx] = _words_triton(probe) == _words_torch(probe)
            except Exception as e:  # no triton, no compiler: the torch path
                log.debug("word_hash: the Triton kernel is not usable on %s (%s): torch ops instead", device, e)
                _kernel_ok[idx] = False
        return _kernel_ok[idx]


def warm(device: torch.device) -> bool:
    """Check (and so compile) the hash kernel on ``device`` now; whether it is used there (never off CUDA)."""
    return device.type == "cuda" and _use_triton(device)


def word_hash(t: torch.Tensor) -> int:
    """The checksum of a contiguous 1-D uint8 tensor (see the module docstring), as an unsigned 64-bit int."""
    _check(t)
    n = t.numel()
    b = n // 8
    total = 0
    if b:
        head = t[: 8 * b]
        if head.data_ptr() % 8:  # an unaligned view: words need an aligned copy
            head = head.clone()
        words = head.view(torch.int64)
        total = _words_triton(words) if t.is_cuda and _use_triton(t.device) else _words_torch(words)
    if n % 8:
        tail = int.from_bytes(bytes(t[8 * b:].cpu().tolist()) + bytes(8 - n % 8), "little")
        total += _terms_sum(torch.tensor([_s64(tail)], dtype=torch.int64), b + 1)
    return _finish(total, n)


def word_hash_many(ts: list[torch.Tensor]) -> list[int]:
    """:func:`word_hash` of each of ``ts`` (a group's chunks): on a GPU every kernel is queued before one host sync;
    a tensor the kernel does not take whole (off CUDA, a size or address not a multiple of 8) is hashed alone."""
    out: list[int] = [0] * len(ts)
    queued: list[tuple[int, torch.Tensor]] = []
    for i, t in enumerate(ts):
        _check(t)
        n = t.numel()
        if not (t.is_cuda and n and n % 8 == 0 and t.data_ptr() % 8 == 0 and _use_triton(t.device)):
            out[i] = word_hash(t)
            continue
        words = t.view(torch.int64)
        blocks = -(-words.numel() // _BLOCK)
        part = torch.empty(blocks, dtype=torch.int64, device=t.device)
        _triton()[(blocks,)](words, part, words.numel(), G, C1, C2, BLOCK=_BLOCK, num_warps=8)
        queued.append((i, part.sum()))
    if queued:
        for (i, _), total in zip(queued, torch.stack([x for _, x in queued]).tolist()):
            out[i] = _finish(total, ts[i].numel())
    return out
