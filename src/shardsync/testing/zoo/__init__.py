"""A loader zoo: tiny models whose ``load_weights`` follow vLLM's loader semantics.

Used by the tests, ``make demo``, the simulator and the GPU benchmark (where vLLM itself cannot be
installed). The layers shard like vLLM's: column / row parallel linears, fused QKV with GQA replication
when there are fewer KV heads than TP ranks, merged gate/up, vocab-parallel embeddings with padding,
fused MoE with expert maps (per-expert or fused, transposed 3-D checkpoints)::

    cfg = ZooConfig.qwen3_moe_tiny()
    model = ZooModel(cfg, tp_size=2, tp_rank=0)
    model.load_weights(hf_state_dict(cfg).items())
"""

from .layers import (ColumnParallel, FusedMoE, MergedColumnParallel, QKVParallel, Replicated, RowParallel,
                     VocabParallelEmbedding)
from .zoo_models import ZooConfig, ZooModel, hf_shapes, hf_state_dict

__all__ = ["ColumnParallel", "RowParallel", "QKVParallel", "MergedColumnParallel", "VocabParallelEmbedding",
           "FusedMoE", "Replicated", "ZooConfig", "ZooModel", "hf_shapes", "hf_state_dict"]
