"""Plans through vLLM's own loaders, on top of its layerwise-reload machinery.

``initialize_layerwise_reload`` swaps every layer's live (kernel) tensors for fresh meta tensors in
checkpoint format and keeps the live ones aside. On that state:

* :func:`record_vllm_plan` runs ``model.load_weights`` on recording tensors with the *original* weight
  loaders (vLLM's counting wrappers removed, so no layer is processed) and then puts every live tensor
  back untouched: live weights are never written.
* :func:`validate_plan` checks the plan against the real loaders on random data, one weight group at a
  time, on scratch tensors (live ones are swapped out first), and names the first differing tensor.
* :func:`check_processing` finds tied modules and checks each layer kind's processing against a first
  load (``processor.validate_processing``).
* :class:`LayerApplier` (each sync) materialises a layer's checkpoint-format buffers, writes the plan's
  slices into them and hands the layer to the per-layer processing — during an update window
  ``processor.FreshProcessor``'s first-load replay — as soon as the layer is complete.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterator, Sequence

import torch
from torch import nn

from ...plan.coverage import check_coverage
from ...errors import CoverageError, PlanError, ShardsyncError, SyncError, UnsupportedLoaderOp
from ...plan.pack import GroupUnpacker, layout_group
from ...plan.readback import ParamsReadBack
from ...plan.record import record_plan
from ...types import FALLBACK_PREFIX, ParamMeta, Plan, dtype_of
from ...plan.validate import load_fallbacks, validate_group
from .first_load import TensorSnapshot, buffer_views, fresh_state
from .checkpoint_shapes import engine_checkpoint, refuse_foreign_shapes
from .compat import is_deferred_attention_layer, no_mtp_completeness_check, skip_load_tensors
from .processor import find_aliases, kind_of, layout_mismatch, restore_live, validate_processing

__all__ = ["record_vllm_plan", "validate_plan", "check_processing", "direct_modules", "reloaded_modules", "begin_reload", "LayerApplier",
           "model_tensors", "vllm_context", "refuse_rebind_under_cuda_graphs"]


def _reload():
    from vllm.model_executor.model_loader.reload import layerwise, meta, utils

    return layerwise, meta, utils


@contextlib.contextmanager
def vllm_context(vllm_config) -> Iterator[None]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config), no_mtp_completeness_check(), torch.no_grad():
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
def checkpoint_format(model: nn.Module) -> Iterator[dict[nn.Module, TensorSnapshot]]:
    """Model in checkpoint format on meta tensors, original loaders. Yields every module's exact live
    tensor slots; on exit each module gets exactly those back (``None`` entries included: vLLM's own
    snapshot drops them, which deletes e.g. an int8 layer's ``weight = None`` attribute)."""
    layerwise, _, _ = _reload()
    live = {m: TensorSnapshot.of(m) for m in model.modules()}
    layerwise.initialize_layerwise_reload(model)
    try:
        _unwrap_loaders(model)
        yield live
    finally:
        restore_live(model, live)
        _unwrap_loaders(model)


def written_modules(plan: Plan) -> list[str]:
    return sorted({m for g in plan.groups for m in group_modules(plan, g)})


def group_modules(plan: Plan, g) -> set[str]:
    """Modules a group writes: its scatters' and fills' destinations; a fallback's scratch stands for
    the parameters its real loader writes."""
    fb = {f.scratch: f.dests for f in plan.fallback}
    out: set[str] = set()
    for d in {*(s.dst for s in g.scatters), *(f.dst for f in g.fills)}:
        out.update(_module_of(x)[0] for x in fb.get(d, (d,)))
    return out


def check_processing(model: nn.Module, vllm_config, plan: Plan, *, rank: int,
                     validate: bool = True) -> tuple[dict, dict, dict[str, str]]:
    """Tied modules, per layer kind the processing mode (see processor.validate_processing), and which written
    modules a sync writes directly (``direct_modules``). Returns ``(aliases, {kind: KindReport}, {module: why
    not direct, "" where direct})``; without ``validate`` no kind is checked (all rebind, none direct)."""
    written = written_modules(plan)
    try:
        for name in written:
            fresh_state(model.get_submodule(name), name)  # the first-load state must be known
        aliases = find_aliases(model, written)
    except PlanError as e:
        raise PlanError(f"rank {rank}: {e}") from None
    if not validate:
        return aliases, {}, {m: "not validated (validate=False)" for m in written}
    try:
        with vllm_context(vllm_config), checkpoint_format(model) as live:
            reports = validate_processing(model, [*written, *aliases], live, dtype=vllm_config.model_config.dtype)
            direct = direct_modules(model, plan, aliases, reports, live)
    except (PlanError, SyncError) as e:
        raise PlanError(f"rank {rank}: processing check: {e}") from None
    except Exception as e:  # a layer's processing fails on random checkpoint-format data
        raise PlanError(f"rank {rank}: processing check failed: {type(e).__name__}: {e}") from e
    return aliases, reports, direct


def direct_modules(model: nn.Module, plan: Plan, aliases: dict, reports: dict, live: dict) -> dict[str, str]:
    """For every module the plan writes: "" where a sync may scatter straight into its live tensors (no layerwise
    buffer, no processing), else why not. Direct: its kind's check found first-load processing to be the identity
    (``KindReport.direct``) — or it has no quant method (nothing processes it) — and its checkpoint-format tensors
    have the live tensors' layout. Any doubt keeps the general path: tied modules and their partners, modules with
    buffer views or written through a fallback loader, attention-like layers (re-processed at finalize)."""
    tied = {*aliases, *(p for hits in aliases.values() for p, _ in hits.values())}
    viewed = {x for v in buffer_views(model) for x in (v.owner, v.holder)}
    fallback = {_module_of(d)[0] for f in plan.fallback for d in f.dests}
    out: dict[str, str] = {}
    for name in written_modules(plan):
        layer = model.get_submodule(name)
        if name in tied:
            out[name] = "tied to another module"
        elif name in viewed:
            out[name] = "a buffer views its tensors"
        elif name in fallback:
            out[name] = "written by its real loader (fallback)"
        elif is_deferred_attention_layer(layer):
            out[name] = "attention-like: vLLM re-processes it at finalize"
        elif getattr(layer, "quant_method", None) is not None:
            rep = reports.get(kind_of(layer))
            out[name] = "no processing check for its kind" if rep is None else "" if rep.direct else rep.direct_detail
        else:
            out[name] = layout_mismatch(TensorSnapshot.of(layer), live[layer])
    return out


def reloaded_modules(model: nn.Module, plan: Plan, direct: Sequence[str], aliases: dict) -> list[str]:
    """The modules a sync hands to vLLM's layerwise reload, in model order: those the plan writes on the general
    path (layerwise buffers + first-load processing), the modules tied to a written one (re-processed with their
    partner) and every attention-like layer (vLLM re-processes those at finalize from what the others loaded:
    MLA's absorbed ``W_UK_T``/``W_UV``). Every other module — written directly, or not written at all — keeps its
    live tensors: vLLM's reload would put an unwritten module's tensors back as they were, at a cost per module
    per sync (a 24-layer Qwen3 on CPU: 10 ms for all 321 modules, 2.5 ms for its attention layers alone)."""
    general = set(written_modules(plan)) - set(direct)
    return [n for n, m in model.named_modules()
            if n in general or n in aliases or is_deferred_attention_layer(m)]


def begin_reload(model: nn.Module, reloaded: Sequence[str]) -> None:
    """vLLM's ``initialize_layerwise_reload`` on the ``reloaded`` modules only (:func:`reloaded_modules`); the
    others keep their live tensors (vLLM skips a layer whose reload is already set up: such a mark is put on them
    and taken off afterwards, so its finalize leaves them alone too)."""
    layerwise, _, _ = _reload()
    keep = set(reloaded)
    marked = [layerwise.get_layerwise_info(m) for n, m in model.named_modules() if n not in keep]
    for info in marked:
        info.load_numel_total = 0
    try:
        layerwise.initialize_layerwise_reload(model)
    finally:
        for info in marked:
            info.reset()


def record_vllm_plan(model: nn.Module, vllm_config, metadata: Sequence[ParamMeta], *, rank: int,
                     consumer: str) -> Plan:
    """Dry-run the model's own ``load_weights`` on recording tensors; live weights untouched."""
    refuse_foreign_shapes(metadata, vllm_config, rank=rank)
    with vllm_context(vllm_config), checkpoint_format(model):
        tensors = model_tensors(model)
        plan = record_plan(metadata=metadata, load_weights=model.load_weights, params=tensors,
                           consumer=consumer, rank=rank, device=_device_of(model), allow_fallback=True)
        _require_coverage(plan, tensors, rank, lambda: _checkpoint_plan(model, vllm_config, tensors, rank, consumer))
        unwritten = _unwritten_modules(model, tensors, plan)
    _refuse_unwritten(model, plan, unwritten, rank)
    _refuse_deferred_attention(model, plan, rank)
    return plan


def _unwritten_modules(model: nn.Module, tensors: dict, plan: Plan) -> dict[str, list[str]]:
    """Modules holding checkpoint parameters (what vLLM's reload materialises; buffers such as a rotary cache are
    computed, not loaded) that the plan never writes: ``{module: [tensor names]}``. Attention-like layers
    (re-processed at finalize from their partners; their scales are not trainer tensors) are left out."""
    written = {id(model.get_submodule(m)) for m in written_modules(plan)}  # a module may sit under two names
    skip = skip_load_tensors()
    out: dict[str, list[str]] = {}
    for n, t in tensors.items():
        mod, attr = _module_of(n)
        m = model.get_submodule(mod)
        if t.is_meta and t.numel() and attr not in skip and id(m) not in written and attr in m._parameters:
            out.setdefault(mod, []).append(n)
    return {m: ns for m, ns in out.items() if not is_deferred_attention_layer(model.get_submodule(m))}


def _refuse_unwritten(model: nn.Module, plan: Plan, unwritten: dict[str, list[str]], rank: int) -> None:
    """A module no sync writes would keep its old weights after every sync while the engine reports the new
    version: refused at init, unless it shares its tensors with a written one (a tied LM head)."""
    if not unwritten:
        return
    left = sorted(set(unwritten) - set(find_aliases(model, written_modules(plan))))
    if left:
        names = [n for m in left for n in unwritten[m]]
        raise CoverageError(f"rank {rank}: {len(left)} engine module(s) hold checkpoint tensors that no trainer "
                            f"tensor writes, e.g. {names[:6]}: after a sync they would keep their old weights — "
                            "the trainer's tensors lack them, or their names do not map to them")


def _require_coverage(plan: Plan, tensors: dict, rank: int, reference=None) -> None:
    """Every tensor a sync materialises (the checkpoint-format tensors of each module the plan writes)
    must be written in full by the plan: anything else would be processed from uninitialised memory — unless
    loading the engine's own checkpoint (``reference()``: its plan, or None) leaves it just as unwritten: then
    first-load processing computes it (FP8 online quantisation's ``weight_scale``), as at every sync."""
    mods = set(written_modules(plan))
    by_loader = {d for f in plan.fallback for d in f.dests}  # written whole by the real loader at sync time
    fresh = {n: t for n, t in tensors.items() if _module_of(n)[0] in mods and t.is_meta and t.numel()
             and n not in by_loader}
    report = check_coverage(plan, fresh)
    if report.missing or report.partial:
        ref_plan = reference() if reference is not None else None
        if ref_plan is not None:
            ref = check_coverage(ref_plan, {n: fresh[n] for n in (*report.missing, *report.partial)})
            computed = {*ref.missing, *(n for n, c in ref.partial.items() if report.partial.get(n) == c)}
            report = check_coverage(plan, {n: t for n, t in fresh.items() if n not in computed})
    try:
        report.raise_if_incomplete()
    except CoverageError as e:
        raise CoverageError(f"rank {rank}: {e} — the trainer's tensors do not fill these engine tensors") from None


def _checkpoint_plan(model: nn.Module, vllm_config, tensors: dict, rank: int, consumer: str) -> Plan | None:
    """What loading the engine's own checkpoint writes (a dry run on its headers' metadata), or None."""
    ref = engine_checkpoint(vllm_config)
    if ref is None:
        return None
    try:
        return record_plan(metadata=list(ref[1].values()), load_weights=model.load_weights, params=tensors,
                           consumer=consumer, rank=rank, device=_device_of(model), allow_fallback=True)
    except ShardsyncError:  # no reference: the trainer's coverage stands alone
        return None


def _device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def _module_of(name: str) -> tuple[str, str]:
    mod, _, attr = name.rpartition(".")
    return mod, attr


def _refuse_deferred_attention(model: nn.Module, plan: Plan, rank: int) -> None:
    writes = [(d.name, d.name) for d in plan.dests if not d.name.startswith(FALLBACK_PREFIX)]
    writes += [(x, f.scratch) for f in plan.fallback for x in f.dests]
    for dest, dst in writes:
        mod, _ = _module_of(dest)
        if is_deferred_attention_layer(model.get_submodule(mod)):
            src = next((s.src for g in plan.groups for s in (*g.scatters, *g.fills) if s.dst == dst), dst)
            raise UnsupportedLoaderOp(tensor=src, op=f"copy_ into attention-layer tensor {dest!r}", chain="",
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
            mods = sorted(group_modules(plan, g))
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
    skip = skip_load_tensors()
    # tensors vLLM never reloads (expert maps, masks) are read by the loaders: never sentinel-filled,
    # unless this plan writes them (DeepSeek's e_score_correction_bias comes from the checkpoint)
    writes = {s.dst for s in g.scatters} | {f.dst for f in g.fills}
    tensors = {n: t for n, t in model_tensors(model).items() if _module_of(n)[0] in mods and not t.is_meta
               and (_module_of(n)[1] not in skip or n in writes)}
    return validate_group(load_weights=model.load_weights, params=tensors, group=g, metas=metas, rank=rank,
                          seed=seed)


class LayerApplier:
    """Per sync: materialise, scatter, process. A module is processed as soon as every group writing it has been
    applied this sync (a layer's processing does not wait for the end of the sync; groups — and the parts of a split
    group, ``plan/split.py`` — complete in any order)."""

    def __init__(self, model: nn.Module, plan: Plan, direct: Sequence[str] = ()):
        self.model, self.plan = model, plan
        self.direct = frozenset(direct)
        """Modules written straight into their live tensors: never materialised, never processed."""
        self.writers: dict[str, frozenset[str]] = {}
        """Each processed module -> the groups writing it."""
        by_mod: dict[str, set[str]] = defaultdict(set)
        for g in plan.groups:
            for mod in group_modules(plan, g):
                if mod not in self.direct:
                    by_mod[mod].add(g.name)
        self.writers = {mod: frozenset(gs) for mod, gs in by_mod.items()}
        self.left: dict[str, set[str]] = {}
        """This sync: module -> its writers not applied yet (``begin``)."""
        self.begin()
        self.group_mods = {g.name: sorted(group_modules(plan, g)) for g in plan.groups}
        self.live_tensors: dict[str, dict[str, torch.Tensor]] = {}
        """A group's direct modules' live tensors by dotted name (the same tensors every sync: the unpacker's copy
        programs are built once)."""
        for g in plan.groups:
            self.live_tensors[g.name] = {n: t for m in self.group_mods[g.name] if m in self.direct
                                         for n, t in _own_tensors(model, m).items()}
        self.staged = {g.name: [m for m in self.group_mods[g.name] if m not in self.direct] for g in plan.groups}
        # fallback tensors land whole in scratch buffers (allocated once) and go through the real loader
        dev = _device_of(model)
        self.scratch = {g.name: {s.dst: torch.empty(s.shape, dtype=dtype_of(s.dst_dtype), device=dev)
                                 for s in g.scatters if s.dst.startswith(FALLBACK_PREFIX)} for g in plan.groups}
        self.layouts = {g.name: layout_group(g) for g in plan.groups}
        self.unpackers = {g.name: GroupUnpacker(g, self.layouts[g.name]) for g in plan.groups}

    def read_back(self, keep_out: Sequence[str] = ()) -> ParamsReadBack:
        """The direct modules' tensors as a delta's base (``plan/readback.py``), judged now (at init: every tensor
        live, no update window open): eligible are the direct modules' own tensors that share no storage with a
        module this applier processes or vLLM reloads (``keep_out``: an attention layer's finalize, a tied partner)."""
        written = {m for mods in self.group_mods.values() for m in mods}
        every = {n: t for m in written for n, t in _own_tensors(self.model, m).items()}
        others = {t.untyped_storage().data_ptr() for m in (written - self.direct) | set(keep_out)
                  for t in _own_tensors(self.model, m).values()}
        direct = {n: t for tensors in self.live_tensors.values() for n, t in tensors.items()}
        eligible = [n for n, t in direct.items() if t.untyped_storage().data_ptr() not in others]
        return ParamsReadBack(self.plan, {**every, **direct}, eligible)

    def apply(self, group: str, buf: torch.Tensor) -> None:
        layerwise, _, _ = _reload()
        staged = self.staged[group]
        for m in staged:
            layer = self.model.get_submodule(m)
            layerwise.materialize_layer(layer, layerwise.LAYERWISE_INFO[layer])
        tensors = dict(self.live_tensors[group])
        for m in staged:
            tensors.update(_own_tensors(self.model, m))
        scratch = self.scratch[group]
        self.unpackers[group].unpack(buf, {**tensors, **scratch})
        load_fallbacks(self.model.load_weights, scratch)
        for m in staged:
            left = self.left[m]
            left.discard(group)
            if left:
                continue
            layer = self.model.get_submodule(m)
            info = layerwise.LAYERWISE_INFO[layer]
            if info.can_load():
                layerwise._layerwise_process(layer, info)

    def begin(self) -> None:
        """A new sync: every processed module waits for all its writers again."""
        self.left = {mod: set(gs) for mod, gs in self.writers.items()}


def _own_tensors(model: nn.Module, m: str) -> dict[str, torch.Tensor]:
    layer = model.get_submodule(m)
    return {f"{m}.{n}" if m else n: t
            for n, t in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]}


def refuse_rebind_under_cuda_graphs(vllm_config, kinds: dict, plan, validated: bool, rank: int) -> None:
    """``rebind`` gives a layer new storage: captured CUDA graphs would keep reading the old one."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", str(mode)) == "NONE":
        return
    rebind = sorted(k for k, r in kinds.items() if r.mode == "rebind")
    if rebind or (not validated and plan.dests):
        raise PlanError(f"rank {rank}: CUDA graphs are captured ({mode}) but layer kinds "
                        f"{rebind or ['(all: validate=False)']} can only be synced by rebinding their tensors, which "
                        "captured graphs would not see: start the engine with enforce_eager=True, or keep validate on")
