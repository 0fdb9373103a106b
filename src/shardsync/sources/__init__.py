"""Trainer-side weight sources: adapters to vLLM's ``WeightSource`` (``adapt``), FSDP2/DTensor
(``fsdp``) and Megatron-style TP·PP·EP layouts (``megatron``)."""

from .adapt import ForeignSource, adapt

__all__ = ["adapt", "ForeignSource"]
