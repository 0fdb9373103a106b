"""Block-wise FP8 (e4m3) quantisation of a weight, 128×128 blocks, as vLLM's online fp8 does.

``quantize_fp8_blocks(w, q, s)`` writes into preallocated ``q`` (float8_e4m3fn, shape of w) and
``s`` (float32, [rows/128, cols/128]) — in place, so kernel tensors keep their addresses (CUDA graphs
stay valid). On CUDA it is one fused Triton kernel (one read of w, one write of q); elsewhere the same
arithmetic in torch::

    q = torch.empty_like(w, dtype=torch.float8_e4m3fn); s = torch.empty(w.shape[-2] // 128 * ..., ...)
    quantize_fp8_blocks(w, q, s)
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
BLOCK = 128


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows // BLOCK, shape[-1] // BLOCK


def quantize_fp8_blocks_torch(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    k = w.shape[-1]
    q2, s2 = block_fp8(w.reshape(-1, k))
    s.copy_(s2)
    q.view(-1, k).copy_(q2)


_kernel = None


def _triton_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def k(w_ptr, q_ptr, s_ptr, K, KB, BLOCK_: tl.constexpr):
            pm = tl.program_id(0)
            pk = tl.program_id(1)
            rows = pm * BLOCK_ + tl.arange(0, BLOCK_)
            cols = pk * BLOCK_ + tl.arange(0, BLOCK_)
            offs = rows[:, None].to(tl.int64) * K + cols[None, :]
            x = tl.load(w_ptr + offs).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x)), 1e-12)
            scale = amax / 448.0
            tl.store(q_ptr + offs, (x / scale).to(tl.float8e4nv))
            tl.store(s_ptr + pm * KB + pk, scale)

        _kernel = k
    return _kernel


def quantize_fp8_blocks(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    k = w.shape[-1]
    rows = w.numel() // k
    if rows % BLOCK or k % BLOCK:
        raise ValueError(f"fp8 block quantisation needs dims divisible by {BLOCK}, got {tuple(w.shape)}")
    if not w.is_cuda:
        quantize_fp8_blocks_torch(w, q, s)
        return
    kern = _triton_kernel()
    kern[(rows // BLOCK, k // BLOCK)](w, q, s, k, k // BLOCK, BLOCK_=BLOCK, num_warps=8)


def block_fp8(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight as DeepSeek-V3-style block FP8: ``(q, scale_inv)`` with ``q`` float8_e4m3fn of ``w``'s shape and
    ``scale_inv`` float32 ``[ceil(rows/bn), ceil(cols/bm)]`` (the dequantisation factor: ``w ≈ q * scale_inv`` per
    tile; edge tiles are partial). Plain torch arithmetic (IEEE division, round-to-nearest-even casts), so the bytes
    are the same on every device: a trainer quantising its bf16 weights and a checkpoint quantised offline by this
    function hold the same bytes."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantises 2-D weights, got shape {tuple(w.shape)}")
    n, m = w.shape
    bn, bm = block
    rn, rm = -(-n // bn), -(-m // bm)
    x = w.float()
    if rn * bn != n or rm * bm != m:  # partial edge tiles: zeros do not change a tile's amax
        x = torch.nn.functional.pad(x, (0, rm * bm - m, 0, rn * bn - n))
    tiles = x.view(rn, bn, rm, bm)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (last bits differ from CPU)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rn * bn, rm * bm)
    if rn * bn != n or rm * bm != m:
        q = q[:n, :m]
    return q.contiguous(), scale.contiguous()
