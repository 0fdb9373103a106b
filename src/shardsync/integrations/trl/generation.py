"""TRL's vLLM generation with shardsync doing the weight sync (colocate and server mode).

TRL (``trl.generation.vllm_generation.VLLMGeneration``, used by ``GRPOTrainer``, ``RLOOTrainer`` and the trainers
sharing it) syncs a colocated engine by calling the model's ``load_weights`` once per parameter, in-process: every
tensor goes through the loaders whole, no first-load processing is replayed and nothing checks the result.
:class:`ShardsyncVLLMGeneration` keeps TRL's generation and replaces two steps:

1. ``_init_vllm`` starts TRL's ``LLM`` with the shardsync weight-transfer backend (``weight_transfer_config``).
2. ``sync_weights`` serves the trainer's parameters through shardsync's trainer backend into that engine: the engine
   pulls only the bytes it keeps, writes them where its plan says and processes each layer as a first load would
   (``integrations/vllm``), with errors naming the tensor. The parameters come from TRL's own ``_iter_named_params``
   (FSDP, DeepSpeed ZeRO-3 gathers, PEFT ``merge_adapter`` -> sync -> ``unmerge_adapter``, its name fixes), read once
   per sync and held merged until the sync is over (:class:`TRLParams`).

Colocated, each training process serves its own engine (a trainer rank and its ``LLM``: ``n_producers=1``,
``world_size=2``); under FSDP every process gathers the full parameters (TRL's own collectives) and serves them
locally. With ``vllm_mode="server"`` TRL keeps its client for generation (its NCCL communicator is not set up) and the
main process syncs the server (``vllm serve`` with the shardsync backend) over its weight-transfer routes, the other
processes taking part in TRL's gathers::

    from shardsync import enable_trl
    enable_trl()                           # before the trainer is built: its VLLMGeneration is shardsync's
    trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...), ...)
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Iterator

import torch

from ...errors import MetadataMismatch, SyncError
from ...source import WeightSource
from ...types import ParamMeta, dtype_name

__all__ = ["ShardsyncVLLMGeneration", "TRLParams", "enable_trl", "enable", "SETTINGS"]

SETTINGS: dict[str, Any] = {}
"""Keyword arguments for every :class:`ShardsyncTrainerInitInfo` this integration builds (group settings such as
``timeout_s``, ``sync_memory_bytes``; ``producer_options``); set by :func:`enable`."""


class TRLParams(WeightSource):
    """TRL's ``_iter_named_params()`` as a shardsync source: one pass per sync, in TRL's order and names.

    The pass is held open after its last tensor: TRL unmerges PEFT adapters (and ends its gathers) when its generator
    resumes after the last one, and the engine still reads the merged tensors until the sync is over. :meth:`close`
    ends it (``sync_weights`` calls it once the sync returned or failed)."""

    def __init__(self, generation: Any):
        self.generation = generation
        self._metas: list[ParamMeta] | None = None
        self._open: Iterator[tuple[str, torch.Tensor]] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._metas is None:  # one pass of its own: gathering is a collective, every process takes part
            metas, seen = [], set()
            for name, t in self.generation._iter_named_params():
                if name in seen:
                    raise MetadataMismatch(f"TRL yields {name!r} twice in one pass")
                seen.add(name)
                metas.append(ParamMeta(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape)))
            if not metas:
                raise MetadataMismatch("TRL's _iter_named_params yielded no parameters")
            self._metas = metas
        return self._metas

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This sync's pass: exactly as many tensors as the metadata names (the generator is not resumed after
        the last one); ``iter_groups`` checks their names and order as for every source."""
        self.close()
        n = len(self.metadata())
        gen = self._open = iter(self.generation._iter_named_params())
        for name, t in islice(gen, n):
            yield name, t.detach()

    def close(self) -> None:
        """End the held pass (TRL's unmerge and gathers after the last tensor); a pass that yields more is an error."""
        gen, self._open = self._open, None
        if gen is None:
            return
        extra = [n for n, _ in gen]
        if extra:
            raise MetadataMismatch(f"TRL yielded {len(extra)} parameters beyond the first sync's "
                                   f"{len(self._metas or [])} ({extra[:3]}): the model changed since the first sync")


def _base() -> type:
    from trl.generation.vllm_generation import VLLMGeneration

    return VLLMGeneration


def _make_class() -> type:
    base = _base()

    class ShardsyncVLLMGeneration(base):  # type: ignore[misc, valid-type]
        """TRL's ``VLLMGeneration`` whose colocated engine is synced by shardsync (module docstring)."""

        def _init_vllm(self) -> None:
            self._shardsync = None
            self._shardsync_source = None
            import trl.generation.vllm_generation as vg

            if self.mode == "server":  # TRL's client for generation; its NCCL communicator is not set up
                client_cls = vg.VLLMClient

                class _NoCommunicator(client_cls):  # type: ignore[misc, valid-type]
                    def init_communicator(self, device: Any = 0) -> None:
                        return None

                vg.VLLMClient = _NoCommunicator
                try:
                    return super()._init_vllm()
                finally:
                    vg.VLLMClient = client_cls
            if self.mode != "colocate":
                return super()._init_vllm()

            llm_cls = vg.LLM

            def with_backend(*args: Any, **kwargs: Any) -> Any:
                kwargs.setdefault("weight_transfer_config", {"backend": "shardsync"})
                return llm_cls(*args, **kwargs)

            vg.LLM = with_backend
            try:
                super()._init_vllm()
            finally:
                vg.LLM = llm_cls

        def sync_weights(self) -> None:
            if self.mode == "server" and not self.accelerator.is_main_process:
                for _ in self._iter_named_params():  # TRL's gathers are collectives: take part in them
                    pass
                return
            if self.mode == "colocate" and self.enable_sleep_mode:  # as TRL: map the weights' memory first
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            src = self._shardsync_source
            try:
                if self._shardsync is None:
                    src = self._shardsync_source = TRLParams(self)
                    client = self.llm if self.mode == "colocate" else _http_client(self.vllm_client.base_url)
                    self._shardsync = _trainer(client, src, self.accelerator, server=self.mode == "server")
                self.last_sync = self._shardsync.send_weights()
            finally:
                if src is not None:
                    src.close()
            if self.mode == "colocate":
                self.llm.reset_prefix_cache()
            else:
                self.vllm_client.reset_prefix_cache()

        def shutdown_shardsync(self) -> None:
            """Close this process's producer and the engine's side (``trainer.vllm_generation.shutdown_shardsync()``
            at the end of training; also run at interpreter exit by vLLM's own teardown)."""
            eng, self._shardsync = self._shardsync, None
            if eng is not None:
                eng.shutdown()

    ShardsyncVLLMGeneration.__qualname__ = "ShardsyncVLLMGeneration"
    return ShardsyncVLLMGeneration


def _http_client(base_url: str) -> Any:
    """The server's weight-transfer routes through shardsync's HTTP client (the engine's error messages kept)."""
    from ..vllm.clients import ShardsyncHTTPClient

    return ShardsyncHTTPClient(base_url)


def _trainer(client: Any, source: TRLParams, accelerator: Any, *, server: bool = False) -> Any:
    """shardsync's trainer backend for this process's own colocated engine, or (``server``) for the OpenAI server
    TRL generates with; the sender is this (main) process, one producer."""
    from ..vllm import compat
    from ..vllm.trainer_backend import ShardsyncTrainerInitInfo

    device = getattr(accelerator, "device", None)
    kw: dict[str, Any] = {"master_address": "127.0.0.1", "master_port": 0, "world_size": 2, "rank": 0,
                          "n_producers": 1, "transport": "tcp" if server else "auto"}
    if device is not None and torch.device(device).type == "cuda" and not server:
        kw["device"] = str(torch.device(device))
    kw.update(SETTINGS)
    if server and "world_size" not in SETTINGS:
        from ..vllm.clients import count_workers

        kw["world_size"] = 1 + (count_workers(client) or 1)
    try:
        return compat.factory_trainer_init(ShardsyncTrainerInitInfo(**kw), client=client, source=source)
    except TypeError as e:
        raise SyncError(f"shardsync.integrations.trl: {e}") from None


_CLASS: list[type] = []


def __getattr__(name: str) -> Any:  # the class is built on first use: importing this module needs no TRL
    if name == "ShardsyncVLLMGeneration":
        if not _CLASS:
            _CLASS.append(_make_class())
        return _CLASS[0]
    raise AttributeError(name)


def enable_trl(**settings: Any) -> type:
    """Every TRL trainer built from now on syncs its vLLM engine (colocated or a server) through shardsync: TRL's
    modules that name ``VLLMGeneration`` get :class:`ShardsyncVLLMGeneration`. ``settings``: keyword arguments of
    ``ShardsyncTrainerInitInfo`` (``timeout_s=``, ``sync_memory_bytes=``, ``producer_options=``...). Returns the
    class."""
    import importlib
    import sys

    from ..vllm.trainer_backend import ShardsyncTrainerInitInfo

    bad = sorted(k for k in settings if k not in ShardsyncTrainerInitInfo.__dataclass_fields__
                 or k in ("rank", "n_producers"))
    if bad:
        raise TypeError(f"shardsync.enable_trl: {bad} are not settings it passes on")
    SETTINGS.clear()
    SETTINGS.update(settings)
    cls = __getattr__("ShardsyncVLLMGeneration")
    base = _base()
    for mod in ("trl.generation.vllm_generation", "trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if getattr(m, "VLLMGeneration", None) is base:
            m.VLLMGeneration = cls
    for name, m in list(sys.modules.items()):  # trainers imported earlier (experimental ones) that hold the name
        if name.startswith("trl.") and getattr(m, "VLLMGeneration", None) is base:
            m.VLLMGeneration = cls
    return cls


enable = enable_trl
