"""Plans through vLLM's own loaders, on top of its layerwise-reload machinery.

``initialize_layerwise_reload`` swaps every layer's live (kernel) tensors for fresh meta tensors in
checkpoint format and keeps the live ones aside. On that state:

* :func:`record_vllm_plan` runs ``model.load_weights`` on recording tensors with the *original* weight
  loaders (vLLM's counting wrappers removed, so no layer is processed) and then puts every live tensor
  back untouched: live weights are never written.
* :func:`validate_plan` checks the plan against the real loaders on random data, one weight group at a
  time, on scratch tensors (live ones are swapped out first), and names the first differing tensor.
* :class:`LayerApplier` (each sync) materialises a layer's checkpoint-format buffers, writes the plan's
  slices into them and hands the layer to vLLM's per-layer processing, which copies the processed
  result into the existing kernel tensors (CUDA graphs stay valid).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterator, Sequence

import torch
from torch import nn

from ...plan.coverage import check_coverage
from ...errors import CoverageError, UnsupportedLoaderOp
from ...plan.pack import GroupUnpacker, layout_group
from ...plan.record import record_plan
from ...types import ParamMeta, Plan
from ...plan.validate import validate_group

__all__ = ["record_vllm_plan", "validate_plan", "LayerApplier", "model_tensors", "vllm_context"]


def _reload():
    from vllm.model_executor.model_loader.reload import layerwise, meta, utils

    return layerwise, meta, utils


@contextlib.contextmanager
def vllm_context(vllm_config) -> Iterator[None]:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    with set_current_vllm_config(vllm_config), disable_mtp_completeness_check(), torch.no_grad():
        yield


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model by its dotted name (tied ones under each name)."""
    out = dict(model.named_parameters(remove_duplicate=False))
    for n, b in model.named_buffers(remove_duplicate=False):
        out.setdefault(n, b)
    return out


def _unwrap_loaders(model: nn.Module) -> None:
    layerwise, _, utils = _reload()
    for layer in model.modules():
        for t in utils.get_layer_tensors(layer).values():
            loader = getattr(t, "weight_loader", None)
            if loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
                t.weight_loader = layerwise._get_original_loader(t)


@contextlib.contextmanager
def checkpoint_format(model: nn.Module) -> Iterator[None]:
    """Model in checkpoint format on meta tensors, original loaders; live tensors restored on exit."""
    layerwise, _, _ = _reload()
    layerwise.initialize_layerwise_reload(model)
    try:
        _unwrap_loaders(model)
        yield
    finally:
        for layer in model.modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is not None and info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
                info.reset()
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
        _unwrap_loaders(model)
        layerwise.LOADING_LAYERS.clear()


def record_vllm_plan(model: nn.Module, vllm_config, metadata: Sequence[ParamMeta], *, rank: int,
                     consumer: str) -> Plan:
    """Dry-run the model's own ``load_weights`` on recording tensors; live weights untouched."""
    with vllm_context(vllm_config), checkpoint_format(model):
        tensors = model_tensors(model)
        plan = record_plan(metadata=metadata, load_weights=model.load_weights, params=tensors,
                           consumer=consumer, rank=rank, device=_device_of(model))
        _require_coverage(plan, tensors, rank)
    _refuse_deferred_attention(model, plan, rank)
    return plan


def _require_coverage(plan: Plan, tensors: dict, rank: int) -> None:
    """Every tensor a sync materialises (the checkpoint-format tensors of each module the plan writes)
    must be written in full by the plan: anything else would be processed from uninitialised memory."""
    mods = {_module_of(d.name)[0] for d in plan.dests}
    fresh = {n: t for n, t in tensors.items() if _module_of(n)[0] in mods and t.is_meta and t.numel()}
    report = check_coverage(plan, fresh)
    try:
        report.raise_if_incomplete()
    except CoverageError as e:
        raise CoverageError(f"rank {rank}: {e} — the trainer's tensors do not fill these engine tensors") from None


def _device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def _module_of(name: str) -> tuple[str, str]:
    mod, _, attr = name.rpartition(".")
    return mod, attr


def _refuse_deferred_attention(model: nn.Module, plan: Plan, rank: int) -> None:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    for d in plan.dests:
        mod, _ = _module_of(d.name)
        if is_deferred_attention_layer(model.get_submodule(mod)):
            src = next((s.src for g in plan.groups for s in (*g.scatters, *g.fills) if s.dst == d.name), d.name)
            raise UnsupportedLoaderOp(tensor=src, op=f"copy_ into attention-layer tensor {d.name!r}", chain="",
                                      rank=rank, detail="vLLM reprocesses attention layers only at finalize by "
                                                        "re-running their loaders; not replayable")


def validate_plan(model: nn.Module, vllm_config, metadata: Sequence[ParamMeta], plan: Plan, *, rank: int,
                  seed: int = 1234) -> int:
    """Check the plan against the engine's real loaders on random data, group by group, on scratch
    tensors. Returns the number of tensors compared; raises PlanError naming the first difference."""
    layerwise, meta_mod, utils = _reload()
    by_group: dict[str, list[ParamMeta]] = defaultdict(list)
    from ...plan.groups import weight_group

    for m in metadata:
        by_group[weight_group(m.name)].append(m)
    compared = 0
    with vllm_context(vllm_config), checkpoint_format(model):
        for g in plan.groups:
            mods = sorted({_module_of(d)[0] for d in {*(s.dst for s in g.scatters), *(f.dst for f in g.fills)}})
            layers = [model.get_submodule(m) for m in mods]
            swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
            for layer in layers:
                layerwise.materialize_layer(layer, layerwise.LAYERWISE_INFO[layer])
                for name, t in utils.get_layer_tensors(layer).items():  # live (skip) tensors -> scratch clones
                    if name in meta_mod.SKIP_TENSORS and not t.is_meta:
                        scratch = nn.Parameter(t.detach().clone(), requires_grad=False) \
                            if isinstance(t, nn.Parameter) else t.detach().clone()
                        for k, v in t.__dict__.items():
                            scratch.__dict__.setdefault(k, v)
                        swapped.append((layer, name, t))
                        setattr(layer, name, scratch)
            try:
                compared += _validate_group(model, g, by_group[g.name], mods, rank, seed)
            finally:
                for layer in layers:
                    layerwise.restore_layer_on_meta(layer, layerwise.LAYERWISE_INFO[layer])
                for layer, name, t in swapped:
                    setattr(layer, name, t)
    return compared


def _validate_group(model: nn.Module, g, metas: Sequence[ParamMeta], mods: Sequence[str], rank: int,
                    seed: int) -> int:
    tensors = {n: t for n, t in model_tensors(model).items() if _module_of(n)[0] in mods and not t.is_meta}
    return validate_group(load_weights=model.load_weights, params=tensors, group=g, metas=metas, rank=rank,
                          seed=seed)


class LayerApplier:
    """Per sync: materialise, scatter, process. Modules are processed as soon as the last group that
    writes them has been applied (a layer's processing does not wait for the end of the sync)."""

    def __init__(self, model: nn.Module, plan: Plan):
        self.model, self.plan = model, plan
        last: dict[str, str] = {}
        for g in plan.groups:
            for name in {*(s.dst for s in g.scatters), *(f.dst for f in g.fills)}:
                last[_module_of(name)[0]] = g.name
        self.finishing: dict[str, list[str]] = defaultdict(list)
        for mod, gname in last.items():
            self.finishing[gname].append(mod)
        self.group_mods = {g.name: sorted({_module_of(d)[0] for d in {*(s.dst for s in g.scatters),
                                                                        *(f.dst for f in g.fills)}})
                           for g in plan.groups}
        self.layouts = {g.name: layout_group(g) for g in plan.groups}
        self.unpackers = {g.name: GroupUnpacker(g, self.layouts[g.name]) for g in plan.groups}

    def apply(self, group: str, buf: torch.Tensor) -> None:
        layerwise, _, _ = _reload()
        mods = self.group_mods[group]
        for m in mods:
            layer = self.model.get_submodule(m)
            layerwise.materialize_layer(layer, layerwise.LAYERWISE_INFO[layer])
        tensors = {}
        for m in mods:
            layer = self.model.get_submodule(m)
            for n, t in list(layer.named_parameters(recurse=False)) + list(layer.named_buffers(recurse=False)):
                tensors[f"{m}.{n}" if m else n] = t
        self.unpackers[group].unpack(buf, tensors)
        for m in self.finishing.get(group, ()):
            layer = self.model.get_submodule(m)
            info = layerwise.LAYERWISE_INFO[layer]
            if info.can_load():
                layerwise._layerwise_process(layer, info)
