"""The standard a sync is held to: a FRESH vLLM engine started on a checkpoint of the same weights.

    ref = fresh_reference(src_dir, full_state, tp=2, ep=False, out_dir=tmp)   # writes a checkpoint, starts
    n, bad = compare_with(synced_paths, ref.paths)                            # an engine, inspects, stops it

Both engines are inspected the same way (``inspection``): every parameter and buffer after processing
and the outputs of every linear / LM-head kernel on a fixed probe input; greedy tokens where CPU vLLM can
generate.
"""

from __future__ import annotations

import gc
import glob
import os
import shutil
from dataclasses import dataclass, field

import torch

from .inspection import compare_files
from .registration import enable

PROMPT = [{"prompt_token_ids": [1, 17, 42, 99, 7, 3]}]

__all__ = ["FreshReference", "fresh_reference", "inspect_engine", "compare_with", "generate", "engine_kwargs",
           "cpu_env", "save_checkpoint"]


def engine_kwargs(model_dir: str, tp: int, expert_parallel: bool, **extra) -> dict:
    """``LLM`` arguments for a test engine on ``model_dir``. Enables the test registration first (``plugin.enable``):
    in every process of the engine, the ``shardsync`` backend is then the testing engine (``testing.engine``:
    inspection, driver push, the full baseline, on top of the product's pull mode)."""
    enable()
    return dict(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                gpu_memory_utilization=0.4, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel,
                weight_transfer_config={"backend": "shardsync"}, **extra)


def cpu_env(tp: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))


def generate(llm) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def inspect_engine(llm, out_dir: str, tp: int) -> list[str]:
    """Every worker writes what it holds now; returns the files, rank order."""
    llm.init_weight_transfer_engine({"init_info": {"inspect_to": out_dir}})
    return [os.path.join(out_dir, f"inspect_rank{r}.safetensors") for r in range(tp)]


def save_checkpoint(state: dict[str, torch.Tensor], src_dir: str, out_dir: str) -> str:
    """``state`` as a checkpoint beside ``src_dir``'s config (and other non-weight files)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    for f in glob.glob(os.path.join(src_dir, "*")):
        base = os.path.basename(f)
        if os.path.isfile(f) and not base.endswith(".safetensors") and base != "model.safetensors.index.json":
            shutil.copy(f, os.path.join(out_dir, base))
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir


@dataclass
class FreshReference:
    paths: list[str]
    tokens: list[int] | None
    checkpoint: str
    extra: dict = field(default_factory=dict)


def fresh_reference(src_dir: str, state: dict[str, torch.Tensor], *, tp: int, ep: bool, out_dir: str,
                    can_generate: bool = True, **engine_extra) -> FreshReference:
    """Start a fresh engine on ``state`` (written as a checkpoint), inspect it, generate, shut it down."""
    from vllm import LLM

    ckpt = save_checkpoint(state, src_dir, os.path.join(out_dir, "checkpoint"))
    llm = LLM(**engine_kwargs(ckpt, tp, ep, **engine_extra))
    try:
        tokens = generate(llm) if can_generate else None
        paths = inspect_engine(llm, os.path.join(out_dir, "fresh"), tp)
    finally:
        shutdown(llm)
    return FreshReference(paths=paths, tokens=tokens, checkpoint=ckpt)


def shutdown(llm, timeout_s: float = 2.0) -> None:
    """Stop the engine's processes now (vLLM's default waits several seconds before killing them)."""
    try:
        llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
    except Exception:
        pass
    del llm
    gc.collect()


def compare_with(synced: list[str], fresh: list[str]) -> tuple[int, list[str]]:
    """Keys compared, and ``rank{R}:{key}`` for every one that differs."""
    total, bad = 0, []
    for r, (a, b) in enumerate(zip(synced, fresh, strict=True)):
        n, mism = compare_files(a, b)
        total += n
        bad += [f"rank{r}:{k}" for k in mism]
    return total, bad
