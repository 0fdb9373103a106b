"""Trainer-side weight sources: adapters to vLLM's ``WeightSource`` (``adapt``), FSDP2/DTensor
(``fsdp``), Megatron-style TP·PP·EP layouts (``megatron``) and a bf16 trainer's weights as a block-FP8
checkpoint holds them (``quantize``: ``BlockFP8Source``)."""

from .adapt import ForeignSource, adapt

__all__ = ["adapt", "ForeignSource"]
