"""First-load processing for synced layers: after a sync the engine holds what a FRESH engine holds.

vLLM's in-place reload re-runs a layer's ``process_weights_after_loading`` on a quant method that is
already in its post-load state, and the result is not always what a first load gives (on CPU vLLM
0.32: fused MoE takes its "weight update" branch and skips the expert prepack; a tied ``lm_head``
keeps a packed copy of the old embedding; int8 layers process under float32 — see
``docs/vllm-notes.md``). shardsync replays the *first-load* processing instead:

* :func:`install_snapshot_hook` (run by the plugin in every worker, before the model is built) wraps
  vLLM's ``record_metadata_for_reloading`` — called right after the model is constructed, before any
  weight is loaded — and records each module's *fresh state*: its non-tensor attributes and its quant
  method's attributes, before the first processing ever ran.
* :func:`process_fresh` runs a layer's processing from that fresh state on the checkpoint-format
  tensors the sync wrote, under the model's dtype (as the first load does), then either copies the
  result into the live (kernel) tensors and keeps the live state (``inplace``: storage addresses kept,
  CUDA-graph safe) or makes the freshly processed tensors and state the live ones (``rebind``).
  Which mode a layer kind may use is decided at init by :func:`validate_processing`, which also reports
  the layer kinds where vLLM's own reload differs from a first load.

    install_snapshot_hook()                                  # plugin, once per process
    snap = TensorSnapshot.of(layer)                          # exact live tensors, None entries included
    process_fresh(layer, kernel=snap, mode="inplace", dtype=torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import enum
import functools
import types
from dataclasses import dataclass
from typing import Any, Iterator
from weakref import WeakKeyDictionary

import torch
from torch import nn

from ...errors import PlanError, SyncError

__all__ = ["install_snapshot_hook", "FreshState", "TensorSnapshot", "fresh_state", "process_fresh", "probe",
           "run_processing", "set_state", "capture_state", "default_dtype", "scratch_clone", "state_flags",
           "TORCH_INTERNAL"]

TORCH_INTERNAL = frozenset(nn.Module().__dict__)
_FRESH: "WeakKeyDictionary[nn.Module, FreshState]" = WeakKeyDictionary()


def _copy1(v: Any) -> Any:
    """One level of copying for builtin containers (a processing step may mutate them in place)."""
    if type(v) in (dict, list, set):
        return type(v)(v)
    return v


@dataclass
class FreshState:
    """A module's non-tensor state: its own attributes, its quant method's attributes and those of the
    per-layer objects they hold (``nested``: e.g. a compressed-tensors ``scheme`` and its ``kernel``, where CPU
    vLLM keeps the oneDNN handle that owns the packed weight and points at the layer's scale tensors)."""

    attrs: dict[str, Any]
    qm: dict[str, Any] | None
    nested: list[tuple[Any, dict[str, Any]]] = ()  # type: ignore[assignment]


NESTED_DEPTH = 3
"""How deep :func:`capture_state` follows plain objects held in attributes (layer -> scheme -> kernel)."""


def _is_state_object(v: Any) -> bool:
    """A per-layer helper object whose attributes processing may set (a quant scheme, a kernel): not a
    module, tensor, builtin, type, function or a (shared, read-only) config."""
    if isinstance(v, (nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType, types.ModuleType,
                      functools.partial, enum.Enum)):
        return False
    cls = type(v)  # vLLM's own per-layer helpers only: never a shared logger, lock or third-party singleton
    return cls.__module__.startswith("vllm.") and hasattr(v, "__dict__") and not cls.__name__.endswith("Config")


def _nested(roots: list[dict[str, Any]]) -> list[tuple[Any, dict[str, Any]]]:
    out: list[tuple[Any, dict[str, Any]]] = []
    seen: set[int] = set()
    frontier = [v for d in roots for v in d.values()]
    for _ in range(NESTED_DEPTH):
        nxt = []
        for v in frontier:
            for x in (v if type(v) in (list, tuple) else (v,)):
                if id(x) in seen or not _is_state_object(x):
                    continue
                seen.add(id(x))
                d = {k: _copy1(y) for k, y in vars(x).items()}
                out.append((x, d))
                nxt.extend(d.values())
        frontier = nxt
    return out


def capture_state(module: nn.Module) -> FreshState:
    attrs = {k: _copy1(v) for k, v in module.__dict__.items() if k not in TORCH_INTERNAL}
    qm = getattr(module, "quant_method", None)
    qd = {k: _copy1(v) for k, v in vars(qm).items()} if qm is not None and hasattr(qm, "__dict__") else None
    return FreshState(attrs=attrs, qm=qd, nested=_nested([attrs, qd or {}]))


def set_state(module: nn.Module, state: FreshState) -> None:
    """Make the module's non-tensor state exactly ``state`` (attributes added since are removed)."""
    for k in [k for k in module.__dict__ if k not in TORCH_INTERNAL and k not in state.attrs]:
        del module.__dict__[k]
    for k, v in state.attrs.items():
        module.__dict__[k] = _copy1(v)
    qm = getattr(module, "quant_method", None)
    if state.qm is not None and qm is not None:
        qm.__dict__.clear()
        qm.__dict__.update({k: _copy1(v) for k, v in state.qm.items()})
    for obj, d in state.nested:
        obj.__dict__.clear()
        obj.__dict__.update({k: _copy1(v) for k, v in d.items()})


def install_snapshot_hook() -> None:
    """Record every module's fresh state when vLLM builds a model (guarded against double install)."""
    from vllm.model_executor.model_loader import utils

    original = utils.record_metadata_for_reloading
    if getattr(original, "_shardsync", False):
        return

    def record_metadata_for_reloading(model: nn.Module) -> None:
        original(model)
        if not _serves_shardsync():
            return
        for m in model.modules():
            _FRESH[m] = capture_state(m)
        _ALIASES[model] = find_buffer_views(model)

    record_metadata_for_reloading._shardsync = True  # type: ignore[attr-defined]
    utils.record_metadata_for_reloading = record_metadata_for_reloading


def _serves_shardsync() -> bool:
    """Whether the model being built belongs to an engine started with the shardsync backend (others are not
    recorded). Where vLLM's current config cannot be read, it is recorded (a shardsync engine needs it)."""
    try:
        from vllm.config import get_current_vllm_config

        from .selection import selects_shardsync

        cfg = get_current_vllm_config()
    except Exception:
        return True
    return selects_shardsync(cfg)


@dataclass(frozen=True)
class BufferView:
    """A non-persistent buffer built as a view of another module's parameter at construction (Mamba's
    ``mixer.conv_weights`` of ``conv1d.weight``). A first load writes the checkpoint values through the
    parameter into it; processing may later give the parameter new storage, but the buffer keeps the
    loaded values — so a sync writes them into it too."""

    holder: str
    buffer: str
    owner: str
    param: str
    offset: int
    """Element offset of the buffer's first element from the parameter's."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]


_ALIASES: "WeakKeyDictionary[nn.Module, list[BufferView]]" = WeakKeyDictionary()


def find_buffer_views(model: nn.Module) -> list[BufferView]:
    owners: dict[int, tuple[str, str, torch.Tensor]] = {}
    for mname, m in model.named_modules():
        for pname, p in m._parameters.items():
            if p is not None and not p.is_meta and p.numel():
                owners.setdefault(p.untyped_storage().data_ptr(), (mname, pname, p))
    out = []
    for hname, h in model.named_modules():
        for bname, b in h._buffers.items():
            if b is None or bname not in h._non_persistent_buffers_set or b.is_meta or not b.numel():
                continue
            hit = owners.get(b.untyped_storage().data_ptr())
            if hit is None or hit[2].dtype != b.dtype or (hit[0], hit[1]) == (hname, bname):
                continue
            out.append(BufferView(holder=hname, buffer=bname, owner=hit[0], param=hit[1],
                                  offset=b.storage_offset() - hit[2].storage_offset(), shape=tuple(b.shape),
                                  stride=tuple(b.stride())))
    return out


def buffer_views(model: nn.Module) -> list[BufferView]:
    return list(_ALIASES.get(model, []))


def state_flags(module: nn.Module) -> list[str]:
    """The boolean switches that are True in the module's recorded first-load state: its own attributes and
    (``qm.``-prefixed) its quant method's, torch's module bookkeeping left out. Empty where none was recorded."""
    st = _FRESH.get(module)
    if st is None:
        return []
    return sorted({f"{p}{k}" for p, d in (("", st.attrs), ("qm.", st.qm or {}))
                   for k, v in d.items() if v is True and k not in TORCH_INTERNAL})


def fresh_state(module: nn.Module, name: str = "") -> FreshState:
    st = _FRESH.get(module)
    if st is None:
        raise PlanError(f"no first-load state recorded for module {name or type(module).__name__!r}: the shardsync "
                        "vLLM plugin must be loaded before the model is built (check VLLM_PLUGINS)")
    return st


@dataclass
class TensorSnapshot:
    """A module's exact tensor slots: parameters and buffers as registered, ``None`` entries included."""

    params: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor | None]
    non_persistent: set[str]

    @classmethod
    def of(cls, module: nn.Module) -> "TensorSnapshot":
        return cls(dict(module._parameters), dict(module._buffers), set(module._non_persistent_buffers_set))

    def place(self, module: nn.Module) -> None:
        module._parameters.clear()
        module._parameters.update(self.params)
        module._buffers.clear()
        module._buffers.update(self.buffers)
        module._non_persistent_buffers_set.clear()
        module._non_persistent_buffers_set.update(self.non_persistent)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in {**self.params, **self.buffers}.items() if t is not None}

    def scratch(self) -> "TensorSnapshot":
        """Clones (same class and attributes) — for validation, which must never write live storage."""
        return TensorSnapshot({k: scratch_clone(v) for k, v in self.params.items()},
                              {k: scratch_clone(v) for k, v in self.buffers.items()}, set(self.non_persistent))


def scratch_clone(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of ``t`` with its class and attributes (weight loaders, TP state): a stand-in for validation."""
    if t is None:
        return None
    c = t.detach().clone()
    if isinstance(t, nn.Parameter):
        c = nn.Parameter(c, requires_grad=False)
    c.__class__ = t.__class__
    c.__dict__.update(t.__dict__)
    return c


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def run_processing(layer: nn.Module) -> None:
    """What vLLM's model loader runs on a layer after loading (the layer's quant method's processing)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    qm = getattr(layer, "quant_method", None)
    if isinstance(qm, QuantizeMethodBase):
        qm.process_weights_after_loading(layer)
        if hasattr(layer, "update_param_tp_status"):
            layer.update_param_tp_status()


def process_fresh(layer: nn.Module, *, kernel: TensorSnapshot, mode: str, dtype: torch.dtype,
                  name: str = "", keep: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """Process ``layer`` (holding checkpoint-format tensors) exactly as a first load would.

    ``inplace``: copy the processed tensors into ``kernel``'s storage, register ``kernel``'s tensors and
    keep the live non-tensor state. ``rebind``: the processed tensors and the state processing built
    become the live ones. ``keep``: ``{name: (input, partner)}`` — where processing left ``input`` in
    place, ``partner`` is registered instead (a tied partner's live tensor stays shared)."""
    live = capture_state(layer)
    set_state(layer, fresh_state(layer, name))
    try:
        with default_dtype(dtype), torch.no_grad():
            run_processing(layer)
    except BaseException:
        set_state(layer, live)
        raise
    done = TensorSnapshot.of(layer)
    for n in kernel.non_persistent:  # alias buffers (views of another module's parameter) are not reloaded:
        if n not in done.buffers and kernel.buffers.get(n) is not None:  # the live one stays
            done.buffers[n] = kernel.buffers[n]
            done.non_persistent.add(n)
    if keep:
        for d in (done.params, done.buffers):
            for n, t in d.items():
                if n in keep and t is keep[n][0]:
                    d[n] = keep[n][1]
    if mode == "rebind":
        done.place(layer)
        return
    pairs = ((done.params, kernel.params, "parameter"), (done.buffers, kernel.buffers, "buffer"))
    for d_new, d_old, kind in pairs:  # everything is checked before any live byte is written
        problem = ""
        if set(d_new) != set(d_old):
            problem = f"first-load processing produced {kind}s {sorted(d_new)}, the live layer has {sorted(d_old)}"
        for n, new in d_new.items():
            old = d_old.get(n)
            if problem or n not in d_old:
                break
            if (new is None) != (old is None) or (new is not None and (new.shape != old.shape or new.dtype != old.dtype)):
                problem = (f"processed {kind} {n!r} is {None if new is None else (tuple(new.shape), new.dtype)}, the "
                           f"live one {None if old is None else (tuple(old.shape), old.dtype)}: cannot copy in place")
        if problem:
            set_state(layer, live)
            kernel.place(layer)
            raise SyncError(f"layer {name!r}: {problem}")
    for d_new, d_old, _ in pairs:
        for n, new in d_new.items():
            old = d_old[n]
            if new is not None and new is not old:
                old.data.copy_(new.data)
    kernel.place(layer)
    set_state(layer, live)


def probe(layer: nn.Module, *, seed: int = 7) -> list[torch.Tensor] | None:
    """Outputs of the layer's kernels on fixed inputs, where the layer kind has a plain entry point
    (linear layers: ``quant_method.apply``; embeddings: lookup and, for LM heads, ``apply``). ``None``
    when the kind has none: its tensors are then compared alone. Fused-MoE kernels are not probed: called
    outside vLLM's forward on synthetic routing, CPU vLLM's kernels crash the process (SIGSEGV under
    expert parallelism, SIGILL at TP2 — seen here); their processed tensors are compared instead."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return None
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(layer, "params_dtype", None) or torch.get_default_dtype()
    dev = next((t.device for t in layer.parameters(recurse=False) if not t.is_meta), torch.device("cpu"))
    with torch.no_grad():
        if isinstance(layer, LinearBase):
            k = getattr(layer, "input_size_per_partition", None) or getattr(layer, "input_size", None)
            if not k:
                return None
            x = torch.randn(3, k, generator=g).to(dtype=dtype, device=dev)
            out = qm.apply(layer, x)
            return [out[0] if isinstance(out, tuple) else out]
        if isinstance(layer, VocabParallelEmbedding):
            ids = torch.randint(0, layer.num_embeddings_per_partition, (5,), generator=g).to(dev)
            outs = [qm.embedding(layer, ids)]
            x = torch.randn(3, layer.embedding_dim, generator=g).to(dtype=dtype, device=dev)
            outs.append(qm.apply(layer, x))
            return outs
    return None
