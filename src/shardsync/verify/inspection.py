"""Inspection for tests and ``shardsync verify``: what a worker holds, written to a file, and two such files compared.

    write_inspection(model, "/tmp/x/inspect_rank0.safetensors")   # every tensor and probe output (model_state)
    n, bad = compare_files(a_path, b_path)                          # keys compared, keys that differ

A worker writes its file when the testing engine (``testing.engine``) gets ``{"inspect_to": dir}`` as init info.
"""

from __future__ import annotations

from torch import nn

from ..integrations.vllm.model_state import compare, inspect_model

__all__ = ["write_inspection", "compare_files"]


def write_inspection(model: nn.Module, path: str) -> int:
    from safetensors.torch import save_file

    tensors = inspect_model(model)
    save_file(tensors, path)
    return len(tensors)


def compare_files(a_path: str, b_path: str) -> tuple[int, list[str]]:
    from safetensors.torch import load_file

    return compare(load_file(a_path), load_file(b_path))
