"""The vLLM APIs shardsync uses that differ between releases, in one place (vLLM 0.26 … 0.32).

    from .compat import trainer_engine_base, check_supported
    class ShardsyncTrainerEngine(trainer_engine_base(ShardsyncTrainerInitInfo)): ...

What differs (read from both releases' sources):

* trainer engines: 0.32's ``TrainerWeightTransferEngine`` is generic over ``[TInitInfo]``, picks the backend from the
  init info's ``backend`` ClassVar and calls ``trainer_init(init_info, *, client, source)``; 0.26's is generic over
  ``[TConfig, TInitInfo]``, declares ``config_cls``, takes the backend name in
  ``WeightTransferTrainerFactory.trainer_init(backend, config, init_info, *, client, source)`` and calls
  ``trainer_init(config=, init_info=, client=, source=)``; its ``__init__`` takes the config first;
* worker engines: 0.26 declares ``trainer_send_weights`` abstract; 0.32 dropped it;
* weight versions: 0.32's ``EngineCore.set_weight_version`` / ``finish_weight_update(weight_version=)`` /
  ``LLM.get_weight_version``; 0.26 has none of them (its clients' ``finish_weight_update()`` takes nothing);
* deferred attention layers: 0.32's ``is_deferred_attention_layer``; 0.26 tests ``Attention``/``MLAAttention``;
* 0.32's ``mtp_validation.disable_mtp_completeness_check``; absent in 0.26 (no such check there);
* 0.32's ``reload.meta.SKIP_LOAD_TENSORS`` is 0.26's ``SKIP_TENSORS``.

Nothing here runs at import beyond reading vLLM's version; :func:`check_supported` is called only where shardsync is
asked to serve (a worker engine built, a trainer engine initialised), so an unsupported vLLM is told once, by name,
and never breaks an engine that does not use shardsync.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import types
from typing import Any, Iterator

from ...errors import ShardsyncError

__all__ = ["SUPPORTED", "UnsupportedVllm", "vllm_version", "check_supported", "trainer_engine_base",
           "trainer_init_args", "trainer_engine_init_args", "finish_weight_update", "has_weight_versions",
           "is_deferred_attention_layer", "no_mtp_completeness_check", "skip_load_tensors", "factory_trainer_init"]

SUPPORTED = ((0, 26), (0, 32))
"""Oldest and newest vLLM minor release shardsync is tested against (CI runs its vLLM tests on both)."""


class UnsupportedVllm(ShardsyncError):
    """The installed vLLM is outside :data:`SUPPORTED`."""


def vllm_version() -> tuple[int, int, int]:
    import vllm

    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", getattr(vllm, "__version__", "0.0.0"))
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else (0, 0, 0)


def check_supported() -> tuple[int, int, int]:
    """The installed vLLM's version; :class:`UnsupportedVllm` naming it when shardsync has not been built for it."""
    v = vllm_version()
    lo, hi = SUPPORTED
    if not lo <= v[:2] <= hi:
        raise UnsupportedVllm(f"shardsync supports vLLM {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}; this is vLLM "
                              f"{'.'.join(map(str, v))}: pin a supported vLLM or pick another weight-transfer backend")
    return v


def _trainer_arity() -> int:
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

    return len(getattr(TrainerWeightTransferEngine, "__parameters__", ()))


def trainer_engine_base(init_info_cls: type) -> type:
    """``TrainerWeightTransferEngine`` parametrised as this vLLM wants it, with ``config_cls`` where it has one."""
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

    if _trainer_arity() == 2:  # 0.26: [TConfig, TInitInfo]
        from vllm.config.weight_transfer import WeightTransferConfig

        base = TrainerWeightTransferEngine[WeightTransferConfig, init_info_cls]  # type: ignore[index]
        return types.new_class("_TrainerBase", (base,), {},
                               lambda ns: ns.update(config_cls=WeightTransferConfig, __module__=__name__))
    return TrainerWeightTransferEngine[init_info_cls]  # type: ignore[index]


def trainer_init_args(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """``(config, init_info)`` from a ``trainer_init`` call of either release: 0.32 passes the init info alone,
    0.26 ``config`` and ``init_info`` (by keyword through its factory, or positionally)."""
    config, info = kwargs.pop("config", None), kwargs.pop("init_info", None)
    if kwargs:
        raise TypeError(f"trainer_init: unexpected arguments {sorted(kwargs)}")
    rest = list(args)
    if info is None and rest:
        info = rest.pop()
    if config is None and rest:
        config = rest.pop()
    if rest or info is None:
        raise TypeError("trainer_init takes (init_info) [vLLM 0.32] or (config, init_info) [vLLM 0.26]")
    return config, info


def factory_trainer_init(init_info: Any, *, client: Any, source: Any) -> Any:
    """``WeightTransferTrainerFactory.trainer_init`` called the way the installed vLLM takes it: 0.32 picks the
    backend from the init info; 0.26 takes the backend's name and a ``WeightTransferConfig`` first."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if _trainer_arity() == 2:
        from vllm.config.weight_transfer import WeightTransferConfig

        backend = type(init_info).backend
        return WeightTransferTrainerFactory.trainer_init(backend, WeightTransferConfig(backend=backend), init_info,
                                                         client=client, source=source)
    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)


def trainer_engine_init_args(config: Any) -> tuple:
    """Positional arguments for ``TrainerWeightTransferEngine.__init__`` (0.26 takes the config first)."""
    if _trainer_arity() == 2:
        if config is None:
            from vllm.config.weight_transfer import WeightTransferConfig

            config = WeightTransferConfig(backend="shardsync")
        return (config,)
    return ()


def finish_weight_update(client: Any, weight_version: str | None) -> None:
    """``client.finish_weight_update`` with the version where the client takes one (0.32's clients, shardsync's
    in-process client), without it where it does not (0.26's HTTP and Ray clients)."""
    fn = client.finish_weight_update
    try:
        takes = "weight_version" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes = True
    if takes:
        fn(weight_version=weight_version)
    else:
        fn()


def has_weight_versions() -> bool:
    """Whether this vLLM labels an engine's weights (``EngineCore.set_weight_version``, 0.32)."""
    from vllm.v1.engine.core import EngineCore

    return hasattr(EngineCore, "set_weight_version")


def is_deferred_attention_layer(layer: Any) -> bool:
    """Whether vLLM's ``finalize_layerwise_reload`` processes ``layer`` after every other layer (attention kinds)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer as fn
    except ImportError:  # 0.26: finalize tests the two classes itself
        from vllm.model_executor.layers.attention import Attention, MLAAttention

        return isinstance(layer, (Attention, MLAAttention))
    return fn(layer)


@contextlib.contextmanager
def no_mtp_completeness_check() -> Iterator[None]:
    """vLLM 0.32's ``disable_mtp_completeness_check`` (a dry run loads only part of a model); nothing in 0.26."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check as check
    except ImportError:
        check = None
    with check() if check is not None else contextlib.nullcontext():
        yield


def skip_load_tensors() -> set[str]:
    """Tensors vLLM's loaders never load (expert maps, masks): 0.32's ``SKIP_LOAD_TENSORS``, 0.26's
    ``SKIP_TENSORS`` (0.32 added ``bias`` to the latter)."""
    from vllm.model_executor.model_loader.reload import meta

    return getattr(meta, "SKIP_LOAD_TENSORS", meta.SKIP_TENSORS)
