"""Per-layer processing during a sync, and its init-time validation.

:class:`FreshProcessor` owns one update window (``begin`` … ``end``). While it is open, vLLM's
``_layerwise_process`` — called by vLLM's own wrapped loaders and by :class:`LayerApplier` alike — is
replaced by :meth:`FreshProcessor.process`, which replays the first-load processing of
:mod:`.fresh`. Modules that share a written tensor without being written themselves (a tied
``lm_head``) are re-processed right after their partner. ``end`` puts every module's exact tensor slots
back (``None`` entries included) except those that were rebound.

:func:`validate_processing` runs at init, once per layer kind (module class + quant method class), on
random checkpoint-format data on scratch tensors: vLLM's reload path, the first-load replay with the
result copied into the live storage (``inplace``), and the first-load replay rebound (``rebind``, the
reference). ``inplace`` is chosen where its probe outputs and tensors equal the reference; the report
names the kinds where vLLM's own reload differs from a first load.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any, Sequence
from weakref import WeakKeyDictionary

import torch
from torch import nn

from ...errors import PlanError, SyncError
from .compat import is_deferred_attention_layer
from .model_state import weight_state_attrs
from .first_load import (TORCH_INTERNAL, BufferView, FreshState, TensorSnapshot, buffer_views, capture_state, probe, process_fresh,
                         scratch_clone, set_state, state_flags)

__all__ = ["FreshProcessor", "KindReport", "check_direct", "find_aliases", "kind_of", "layout_mismatch", "restore_live",
           "state_mismatch", "validate_processing"]


def kind_of(layer: nn.Module) -> str:
    """What a layer's processing depends on, as one key: :func:`validate_processing` checks one layer per key
    and every layer with that key takes the mode chosen for it, so two layers whose processing can take
    different paths must never share one. Module class, quant method class, the checkpoint-format tensors'
    names, ranks, shapes and dtypes (a 3-D conv weight in a linear class processes differently from a 2-D one;
    CPU vLLM picks a GEMM kernel by size) and the boolean switches set in the layer's first-load state, its own
    or its quant method's (``{...}``: those that are True). Such a switch may be set by another module: MLA
    marks its ``kv_b_proj`` ``_cpu_skip_gemm_dispatch``, so on CPU that linear keeps its weight and plain
    ``F.linear`` (``inplace`` is right for it) while an unmarked linear of the same class and quant method
    builds a oneDNN handle from its weight (``inplace`` would keep the old handle). Call it while the layer
    holds checkpoint-format tensors (dry run or mid-sync), so both sides agree; the switches are read from the
    recorded first-load state, which processing never changes."""
    qm = getattr(layer, "quant_method", None)
    sig = ",".join(f"{n}:{t.dim()}d:{'x'.join(map(str, t.shape)) or '-'}:{str(t.dtype).removeprefix('torch.')}"
                   for n, t in sorted(TensorSnapshot.of(layer).tensors().items()))
    base = f"{type(layer).__name__}/{type(qm).__name__}" if qm is not None else type(layer).__name__
    scheme = getattr(layer, "scheme", None)  # compressed-tensors delegates processing to a per-layer scheme
    if scheme is not None:
        base += f"/{type(scheme).__name__}"
    flags = state_flags(layer)
    return f"{base}[{sig}]" + (f"{{{','.join(flags)}}}" if flags else "")


def _reload():
    from vllm.model_executor.model_loader.reload import layerwise, meta

    return layerwise, meta


_LOCK = threading.Lock()
_OPEN: "WeakKeyDictionary[nn.Module, FreshProcessor]" = WeakKeyDictionary()
"""Layer -> the processor whose update window is open for it (several engines may share a process)."""
_ORIGINAL: list[Any] = []


def vllm_layerwise_process() -> Any:
    """vLLM's own ``_layerwise_process``, with shardsync's dispatcher installed in its place (once per
    process): layers of an open update window go to their processor, all others to vLLM's function."""
    layerwise, _ = _reload()
    with _LOCK:
        if not _ORIGINAL:
            _ORIGINAL.append(layerwise._layerwise_process)
            layerwise._layerwise_process = _dispatch
    return _ORIGINAL[0]


def _dispatch(layer: nn.Module, info: Any) -> None:
    proc = _OPEN.get(layer)
    if proc is None:
        return _ORIGINAL[0](layer, info)
    return proc.process(layer, info)


def restore_live(model: nn.Module, live: dict[nn.Module, TensorSnapshot], keep: set[nn.Module] = frozenset()) -> None:
    """Close vLLM's layerwise reload on ``model``: every module (but those in ``keep``) gets its exact
    snapshot back, every layer's reload state is cleared, torchao reloading is put back."""
    layerwise, _ = _reload()
    for m, snap in live.items():
        info = layerwise.LAYERWISE_INFO.get(m)
        if info is not None:
            info.reset()
        if m not in keep:
            snap.place(m)
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()


def find_aliases(model: nn.Module, written: Sequence[str]) -> dict[str, dict[str, tuple[str, str]]]:
    """Modules the plan does not write whose tensors are (share storage with) tensors of written modules:
    ``{module: {tensor: (partner module, partner tensor)}}``. Such a module is re-processed after its
    partner; one that also has tensors of its own (which no sync writes) cannot be, and is refused.
    Attention-like layers (MLA's ``W_UK_T``/``W_UV``, views of ``kv_b_proj``) are not aliases: vLLM's
    ``finalize_layerwise_reload`` runs their ``process_weights_after_loading`` after every other layer, from
    their partners' new values, as a first load does."""
    _, meta = _reload()
    owner: dict[tuple[int, int], tuple[str, str]] = {}
    written_set = set(written)
    for name in written:
        for n, t in TensorSnapshot.of(model.get_submodule(name)).tensors().items():
            if t.numel() and not t.is_meta:
                owner.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), (name, n))
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for name, mod in model.named_modules():
        if name in written_set or is_deferred_attention_layer(mod):
            continue  # vLLM's finalize re-processes attention layers after all others, from their partners
        own = {n: t for n, t in TensorSnapshot.of(mod).tensors().items() if n not in meta.SKIP_TENSORS}
        hits = {n: owner[k] for n, t in own.items() if t.numel() and not t.is_meta
                and (k := (t.untyped_storage().data_ptr(), t.storage_offset())) in owner}
        if not hits:
            continue
        rest = sorted(set(own) - set(hits))
        if rest:
            raise PlanError(f"module {name!r} shares {sorted(hits)} with {sorted({p for p, _ in hits.values()})} but "
                            f"also has tensors {rest} that no sync writes: it cannot be re-processed with its partner")
        out[name] = hits
    return out


class FreshProcessor:
    """First-load processing for every layer completed during one update window."""

    def __init__(self, model: nn.Module, *, dtype: torch.dtype, modes: dict[str, str],
                 aliases: dict[str, dict[str, tuple[str, str]]]):
        self.model, self.dtype, self.modes, self.aliases = model, dtype, modes, aliases
        self.names = {m: n for n, m in model.named_modules()}
        order = {n: i for i, n in enumerate(self.names.values())}
        self.derived: dict[str, list[str]] = {}
        self.before_partner: set[str] = set()  # derived modules that come before a partner: processed on its input
        for m, hits in aliases.items():
            for partner, _ in hits.values():
                self.derived.setdefault(partner, []).append(m)
                if order[m] < order[partner]:
                    self.before_partner.add(m)
        self.views: dict[str, list[BufferView]] = {}
        for v in buffer_views(model):
            self.views.setdefault(v.owner, []).append(v)
        self.live: dict[nn.Module, TensorSnapshot] = {}
        self.rebound: set[nn.Module] = set()
        self.done: set[str] = set()
        self.processed: list[str] = []
        self._inputs: dict[tuple[str, str], torch.Tensor] = {}
        self.open = False

    def begin(self, modules: Sequence[str]) -> None:
        """Before vLLM's ``initialize_layerwise_reload``: snapshot the exact tensor slots of ``modules`` (the ones
        handed to vLLM's reload, ``layerwise.reloaded_modules``) and route those layers to :meth:`process`."""
        if self.open:
            raise SyncError("an update window is already open on this engine")
        vllm_layerwise_process()
        self.live = {m: TensorSnapshot.of(m) for m in map(self.model.get_submodule, modules)}
        self.rebound.clear()
        self.done.clear()
        self.processed = []
        self._inputs.clear()
        with _LOCK:
            for m in self.live:
                _OPEN[m] = self
        self.open = True

    def end(self) -> None:
        """After vLLM's ``finalize_layerwise_reload``, or to abort a window: every module not rebound gets
        its exact live tensor slots back, vLLM's per-layer reload state is cleared."""
        with _LOCK:
            for m in self.live:
                if _OPEN.get(m) is self:
                    del _OPEN[m]
        restore_live(self.model, self.live, keep=self.rebound)
        self._inputs.clear()
        self.open = False

    def process(self, layer: nn.Module, info: Any) -> None:
        """Replacement for vLLM's ``_layerwise_process(layer, info)``."""
        layerwise, meta = _reload()
        meta.materialize_layer(layer, info)
        for t in TensorSnapshot.of(layer).tensors().values():
            if hasattr(t, "weight_loader"):
                t.weight_loader = layerwise._get_original_loader(t)
        for n, args in info.loaded_weights:  # what vLLM's wrapped loaders buffered
            param = getattr(layer, n)
            args.arguments["param"] = param
            param.weight_loader(*args.args, **args.kwargs)
        name = self.names[layer]
        self._process(layer, info, name)
        for m in self.derived.get(name, ()):
            if all(p in self.done for p, _ in self.aliases[m].values()) and m not in self.done:
                self._derive(m)

    def _write_views(self, layer: nn.Module, name: str) -> None:
        """Buffers that view this layer's checkpoint-format parameters get the values just loaded."""
        for v in self.views.get(name, ()):
            holder = self.model.get_submodule(v.holder)
            buf = self.live[holder].buffers.get(v.buffer) if holder in self.live else None
            src = getattr(layer, v.param, None)
            if buf is None or src is None:
                continue
            buf.copy_(src.as_strided(v.shape, v.stride, src.storage_offset() + v.offset))

    def _process(self, layer: nn.Module, info: Any, name: str, keep: dict | None = None) -> None:
        self._write_views(layer, name)
        if name in self.derived and any(m in self.before_partner for m in self.derived[name]):
            for n, t in TensorSnapshot.of(layer).tensors().items():
                self._inputs[(name, n)] = t.detach().clone()
        # a module without a quant method has no processing: copying back is what a first load gives
        mode = self.modes.get(kind_of(layer), "rebind") if getattr(layer, "quant_method", None) is not None \
            else "inplace"
        if layer not in self.live:
            raise SyncError(f"layer {name!r} completed outside an update window")
        process_fresh(layer, kernel=self.live[layer], mode=mode, dtype=self.dtype, name=name, keep=keep)
        if mode == "rebind":
            self.rebound.add(layer)
        info.reset()
        self.done.add(name)
        self.processed.append(name)

    def _derive(self, name: str) -> None:
        layerwise, meta = _reload()
        layer = self.model.get_submodule(name)
        info = layerwise.LAYERWISE_INFO[layer]
        meta.materialize_layer(layer, info)
        keep = {}
        for n, (pname, pn) in self.aliases[name].items():
            partner = getattr(self.model.get_submodule(pname), pn)
            src = self._inputs.get((pname, pn)) if name in self.before_partner else partner
            dst = getattr(layer, n)
            if src is None or dst.shape != src.shape or dst.dtype != src.dtype:
                raise SyncError(f"module {name!r}: tensor {n!r} {tuple(dst.shape)} {dst.dtype} cannot take its tied "
                                f"partner {pname}.{pn} ({None if src is None else (tuple(src.shape), src.dtype)})")
            dst.data.copy_(src)
            keep[n] = (dst, partner)
        self._process(layer, info, name, keep=keep)


@dataclass
class KindReport:
    kind: str
    module: str
    """The module the kind was checked on."""
    mode: str
    """``inplace`` (copied into live storage; CUDA-graph safe) or ``rebind``."""
    vllm_reload_differs: bool
    """vLLM's own reload of the same data gives other tensors or outputs than a first load."""
    probed: bool
    """Kernel outputs on a probe input were compared (else tensors alone)."""
    detail: str = ""
    direct: bool = False
    """Writing the checkpoint-format bytes straight into the live tensors, with no processing at all, gives what a
    first load gives (tensors, non-tensor state and probe outputs): a sync scatters into the live parameters, with
    no layerwise buffers and no processing replay (``layerwise.direct_modules``)."""
    direct_detail: str = ""
    """Why not, where ``direct`` is False."""

    def to_dict(self) -> dict:
        return asdict(self)


def layout_mismatch(checkpoint: TensorSnapshot, live: TensorSnapshot) -> str:
    """Why the plan's writes into ``checkpoint``'s materialised (meta) tensors would not land identically in
    ``live``'s tensors of the same names ("" where they would: same shape, dtype, strides, no storage offset)."""
    have = live.tensors()
    for n, t in checkpoint.tensors().items():
        if not t.is_meta:
            continue  # a tensor vLLM never reloads (an expert map) is the live one already
        x = have.get(n)
        if x is None or x.is_meta:
            return f"no live tensor {n!r}"
        if (x.shape, x.dtype, x.stride(), x.storage_offset()) != (t.shape, t.dtype, t.stride(), 0):
            return (f"live {n!r} is {tuple(x.shape)} {x.dtype} strides {x.stride()} offset {x.storage_offset()}, "
                    f"the checkpoint format {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    return ""


_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _plain(v: Any) -> bool:
    return isinstance(v, _PLAIN) or (type(v) in (tuple, list) and all(_plain(x) for x in v))


def state_mismatch(a: FreshState, b: FreshState) -> str:
    """Where two post-processing states differ in what processing may derive from the weights: attribute names
    (the layer's and its quant method's) and plain values (numbers, strings, dtypes, tuples of them); tensors are
    compared by bytes elsewhere and objects (kernels, configs) by neither; torch's module bookkeeping is left out.
    "" where none differs."""
    for where, x, y in (("", a.attrs, b.attrs), ("quant method ", a.qm or {}, b.qm or {})):
        x, y = ({k: v for k, v in d.items() if k not in TORCH_INTERNAL} for d in (x, y))  # a quant method may be a
        if set(x) != set(y):                                                                # module: train/eval mode
            return f"{where}attributes {sorted(set(x) ^ set(y))} differ"
        for k, v in x.items():
            if _plain(v) and _plain(y[k]) and v != y[k]:
                return f"{where}attribute {k!r} is {v!r} after processing random data, {y[k]!r} live"
    return ""


def _fill_random(layer: nn.Module, g: torch.Generator, names: set[str]) -> dict[str, torch.Tensor]:
    """Random checkpoint-format data in the materialised tensors ``names`` (never in live ones)."""
    out = {}
    for n, t in TensorSnapshot.of(layer).tensors().items():
        if n not in names or t.is_meta or not t.numel():
            continue
        if t.dtype.is_floating_point:
            r = torch.rand(t.shape, generator=g) * 0.01 + 0.005 if "scale" in n else torch.randn(t.shape, generator=g) * 0.05
        elif t.dtype == torch.bool:
            r = torch.zeros(t.shape, dtype=torch.bool)
        elif t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
            lo, hi = (0, 100) if t.dtype == torch.uint8 else (-100, 100)
            r = torch.randint(lo, hi, t.shape, generator=g)
        else:
            continue
        t.data.copy_(r.to(t.dtype))
        out[n] = t.detach().clone()
    return out


def _probe(layer: nn.Module) -> list[torch.Tensor] | None:
    try:
        return probe(layer)
    except Exception:  # no runnable probe on this kind: tensors alone are compared
        return None


def _same(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> bool:
    from ...plan.validate import same_bytes

    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(same_bytes(x, y) for x, y in zip(a, b))


def _tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    """Registered tensors and tensor-valued plain attributes of the layer and its quant method (processing
    may keep data there, e.g. CPU vLLM's ``_cpu_unpacked_conv_weight``): an in-place copy that leaves one
    of them stale is caught."""
    out = {n: t.detach().clone() for n, t in TensorSnapshot.of(layer).tensors().items() if not t.is_meta}
    out.update({k: v.detach().clone() for k, v in weight_state_attrs(layer).items()})
    return out


def check_direct(layer: nn.Module, checkpoint: TensorSnapshot, live: TensorSnapshot, inputs: dict[str, torch.Tensor],
                  state: FreshState, st_ref: FreshState, t_ref: dict[str, torch.Tensor],
                  y_ref: list[torch.Tensor] | None) -> tuple[bool, str]:
    """Whether ``inputs`` (checkpoint-format bytes, materialised on ``layer``) written straight into (clones of) the
    live tensors, the live non-tensor state kept and nothing processed, equal a first load of them: the same
    tensors, the same plain state and the same probe outputs. ``(ok, why not)``; the layer is left on the clones."""
    why = layout_mismatch(checkpoint, live) or state_mismatch(st_ref, state)
    if why:
        return False, why
    direct = live.scratch()
    targets = direct.tensors()
    for n, t in inputs.items():
        targets[n].data.copy_(t)
    direct.place(layer)
    set_state(layer, state)
    t_d, y_d = _tensors(layer), _probe(layer)
    if set(t_d) != set(t_ref):
        return False, f"a first load gives tensors {sorted(set(t_ref) ^ set(t_d))} the live layer lacks or has extra"
    bad = [n for n in t_d if not _same([t_d[n]], [t_ref[n]])]
    if bad:
        return False, f"processing changes {bad[:4]}: the checkpoint bytes are not what the live tensors hold"
    if not _same(y_d, y_ref):
        return False, "the live kernels compute other outputs from the checkpoint bytes than a first load's"
    return True, ""


def validate_processing(model: nn.Module, modules: Sequence[str], live: dict[nn.Module, TensorSnapshot], *,
                        dtype: torch.dtype, seed: int = 4321) -> dict[str, KindReport]:
    """One check per layer kind among ``modules`` (which must be in checkpoint format on meta, inside
    the dry-run context); live storage is never written."""
    layerwise, meta = _reload()
    reps: dict[str, str] = {}
    for name in modules:
        layer = model.get_submodule(name)
        if getattr(layer, "quant_method", None) is not None:
            reps.setdefault(kind_of(layer), name)
    out: dict[str, KindReport] = {}
    for kind, name in reps.items():
        layer = model.get_submodule(name)
        info = layerwise.LAYERWISE_INFO[layer]
        on_meta = TensorSnapshot.of(layer)
        saved = (info.kernel_tensors, info.kernel_non_persistent_buffers, info.load_numel, info.load_numel_total,
                 list(info.loaded_weights))
        state = capture_state(layer)
        g = torch.Generator().manual_seed(seed)

        materialised = {n for n, t in on_meta.tensors().items() if t.is_meta}

        def load(inputs: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
            on_meta.place(layer)
            meta.materialize_layer(layer, info)
            for n, t in on_meta.tensors().items():  # live tensors (expert maps, biases): scratch clones
                if n not in materialised:
                    setattr(layer, n, scratch_clone(t))
            if inputs is None:
                return _fill_random(layer, g, materialised)
            for n, t in inputs.items():
                getattr(layer, n).data.copy_(t)
            return inputs

        try:
            inputs = load()
            ref = live[layer].scratch()
            process_fresh(layer, kernel=ref, mode="rebind", dtype=dtype, name=name)
            t_ref, y_ref, st_ref = _tensors(layer), _probe(layer), capture_state(layer)
            set_state(layer, state)

            load(inputs)
            direct, direct_detail = check_direct(layer, on_meta, live[layer], inputs, state, st_ref, t_ref, y_ref)
            set_state(layer, state)

            load(inputs)
            inplace_ok, detail = True, ""
            try:
                process_fresh(layer, kernel=live[layer].scratch(), mode="inplace", dtype=dtype, name=name)
                t_in, y_in = _tensors(layer), _probe(layer)
                inplace_ok = set(t_in) == set(t_ref) and _same(list(t_in.values()), [t_ref[n] for n in t_in]) \
                    and _same(y_in, y_ref)
                if not inplace_ok:
                    detail = "live state after an in-place copy does not compute what a first load computes"
            except SyncError as e:
                inplace_ok, detail = False, str(e)
            set_state(layer, state)

            load(inputs)
            scratch = live[layer].scratch()
            info.kernel_tensors = ({k: v for k, v in scratch.params.items() if v is not None},
                                   {k: v for k, v in scratch.buffers.items() if v is not None})
            info.kernel_non_persistent_buffers = set(scratch.non_persistent)
            info.loaded_weights, info.load_numel_total = [], 1
            try:
                vllm_layerwise_process()(layer, info)
                # tensors only: the kernels vLLM's reload builds are never run. On CPU vLLM 0.32 it re-processes
                # int8 layers under float32, and the oneDNN handle it builds then writes float32 results into a
                # bfloat16 output (a heap overflow that killed the worker later, in a destructor).
                t_v = _tensors(layer)
                differs = not (set(t_v) == set(t_ref) and _same(list(t_v.values()), [t_ref[n] for n in t_v]))
            except Exception as e:  # vLLM's reload path fails outright on this kind
                differs, detail = True, (detail + "; " if detail else "") + f"vLLM reload fails: {type(e).__name__}: {e}"
            out[kind] = KindReport(kind=kind, module=name, mode="inplace" if inplace_ok else "rebind",
                                   vllm_reload_differs=differs, probed=y_ref is not None, detail=detail,
                                   direct=direct, direct_detail=direct_detail)
        finally:
            set_state(layer, state)
            on_meta.place(layer)
            (info.kernel_tensors, info.kernel_non_persistent_buffers, info.load_numel, info.load_numel_total,
             info.loaded_weights) = saved
    return out
