"""What an engine holds, for a byte comparison with a FRESH load of the same weights (``fresh_load``).

Every parameter and buffer of every module (by dotted name, after processing — e.g. CPU-prepacked MoE
experts), tensors kept as plain attributes of a module or its quant method, and, where CPU vLLM keeps
weights in opaque packed handles (linear layers, LM heads), the outputs of each such layer's kernel on a
fixed probe input.

    tensors = inspect_model(model)                  # {"t:<name>": tensor, "p:<module>#<i>": probe output}
    n, bad = compare(tensors, other)                # keys compared, keys that differ (or exist on one side)
"""

from __future__ import annotations

import torch
from torch import nn

from ...plan.validate import same_bytes
from .first_load import probe

__all__ = ["inspect_model", "compare", "is_weight_state", "weight_state_attrs"]


def inspect_model(model: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for mname, mod in model.named_modules():
            for n, t in [*mod._parameters.items(), *mod._buffers.items()]:
                if t is None or t.is_meta or not t.numel():
                    continue
                key = f"t:{mname}.{n}" if mname else f"t:{n}"
                out[key] = t.detach().contiguous().cpu().clone()
            for key, t in weight_state_attrs(mod).items():  # data processing keeps outside registered tensors
                prefix, n = key.split(":", 1)
                out[f"{prefix}:{mname}.{n}"] = t.detach().contiguous().cpu().clone()
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            try:
                ys = probe(mod)
            except Exception as e:  # a kernel that cannot run on a probe: its tensors are still compared
                out[f"e:{mname}"] = torch.tensor(list(f"{type(e).__name__}".encode()), dtype=torch.uint8)
                continue
            for i, y in enumerate(ys or ()):
                out[f"p:{mname}#{i}"] = y.detach().contiguous().cpu().clone()
    return out


def is_weight_state(name: str, t) -> bool:
    """A tensor kept as a plain attribute that belongs to the weights (not runtime state: KV and SSM caches
    are bound to attention / Mamba layers as attributes and differ between any two engines)."""
    return isinstance(t, torch.Tensor) and not t.is_meta and bool(t.numel()) and "cache" not in name.lower()


def weight_state_attrs(mod: nn.Module) -> dict[str, torch.Tensor]:
    """Weight-state tensors kept as plain attributes of ``mod`` (``a:<name>``) and of its quant method
    (``q:<name>``)."""
    qm = getattr(mod, "quant_method", None)
    return {f"{prefix}:{n}": t for prefix, d in (("a", mod.__dict__), ("q", getattr(qm, "__dict__", {})))
            for n, t in d.items() if is_weight_state(n, t)}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[int, list[str]]:
    bad = sorted(f"{k} (only in {'synced' if k in a else 'fresh'})" for k in a.keys() ^ b.keys())
    bad += [k for k in sorted(a.keys() & b.keys()) if not same_bytes(a[k], b[k])]
    return len(a.keys() | b.keys()), bad
