"""The FP8 block-quantisation process step (torch path on CPU; the Triton path runs in the GPU benchmark)."""

from __future__ import annotations

import pytest
import torch

from shardsync.kernels.fp8 import FP8_MAX, quantize_fp8_blocks, scale_shape


@pytest.mark.parametrize("shape", [(256, 384), (2, 128, 256)])
def test_block_scales_and_dequantised_values(shape) -> None:
    w = (torch.randn(shape) * torch.linspace(0.01, 3, shape[-1])).to(torch.bfloat16)
    q = torch.full(shape, float("nan")).to(torch.float8_e4m3fn)
    s = torch.full(scale_shape(shape), float("nan"))
    quantize_fp8_blocks(w, q, s)
    x = w.float().reshape(-1, shape[-1])
    blocks = x.view(-1, 128, shape[-1] // 128, 128)
    assert torch.equal(s, blocks.abs().amax(dim=(1, 3)) / FP8_MAX)  # one scale per 128x128 block
    deq = q.float().reshape(-1, shape[-1]).view_as(blocks) * s[:, None, :, None]
    assert not torch.isnan(deq).any()
    rel = (deq - blocks).norm() / blocks.norm()
    assert rel < 0.05, rel  # e4m3 keeps 3 mantissa bits


def test_shapes_not_divisible_by_the_block_are_refused() -> None:
    w = torch.randn(100, 128)
    with pytest.raises(ValueError, match="divisible by 128"):
        quantize_fp8_blocks(w, torch.empty(100, 128, dtype=torch.float8_e4m3fn), torch.empty(1, 1))
