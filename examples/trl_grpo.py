"""TRL's GRPOTrainer with its colocated vLLM engine synced by shardsync: one line before the trainer is built.

    python examples/trl_grpo.py MODEL_DIR      # a Hugging Face model directory vLLM can serve (CPU: a tiny one)

Everything else is TRL's own: ``GRPOConfig(use_vllm=True, vllm_mode="colocate")``, LoRA through ``peft_config``
(TRL merges the adapter, shardsync syncs the merged weights, TRL unmerges). Each sync's outcome is kept in
``trainer.vllm_generation.last_sync`` (version, bytes sent, who completed or was dropped).
"""

from __future__ import annotations

import sys


def main(model_dir: str) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from shardsync import enable_trl

    enable_trl(timeout_s=60.0)  # <- the one line: TRL's VLLMGeneration is shardsync's from now on

    ds = Dataset.from_dict({"prompt": ["hello world the", "the cat", "a b c", "dog d e"] * 4})
    cfg = GRPOConfig(output_dir="/tmp/trl-grpo-shardsync", use_cpu=True, bf16=False, max_steps=3,
                     per_device_train_batch_size=4, num_generations=2, max_completion_length=8, report_to=[],
                     save_strategy="no", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
                     vllm_gpu_memory_utilization=0.3)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=cfg, train_dataset=ds)
    try:
        trainer.train()
        print("last sync:", {k: trainer.vllm_generation.last_sync[k] for k in ("version", "bytes_sent", "seconds")})
    finally:
        trainer.vllm_generation.shutdown_shardsync()


if __name__ == "__main__":
    main(sys.argv[1])
