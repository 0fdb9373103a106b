"""SkyRL's weight-sync strategy ``shardsync``: trainer ranks serve, every inference worker pulls point-to-point.

SkyRL (``skyrl-train``) moves weights through a ``WeightTransferStrategy``: an init info made from the config, a
sender on every trainer rank and a receiver in every inference worker. What each call does here:

- ``create_init_info(cfg)`` (every trainer rank): the group's settings from ``cfg.generator.shardsync`` (any
  ``GroupSettings`` name: ``transport``, ``timeout_s``, ``verify_checksums``, ``mac``, ``delta``... and
  ``ProducerConfig`` fields for the trainer ranks), a fresh token, and the number of inference workers (SkyRL's
  engines × TP × PP × DP). Only trainer rank 0's reaches the engines.
- ``create_sender`` (every trainer rank, in lockstep): rank 0's settings and token reach the others
  (``broadcast_object_list`` over the trainer group).
- ``send_chunks(chunks)`` (every trainer rank, the same full tensors on each, as SkyRL's extractors gather them):
  each tensor is served by ONE rank (``sources/stream.py``). On the first update the chunks are read to learn the
  metadata, rank 0's producer (the coordinator) starts and its address reaches the other ranks; then rank 0 sends
  the engines a :class:`ShardsyncWeightUpdateRequest` (the version and the coordinator) while every rank runs
  ``Producer.sync``.
- ``receive_weights(request)`` (every inference worker, from SkyRL's ``WorkerWrap.load_weights``): a consumer with an
  identity plan (``engine/consumer/tensor_receiver.py``) pulls each group from the rank serving it and yields its
  ``(name, tensor)`` pairs as the group lands; SkyRL loads them into vLLM as it loads a broadcast.

An engine that fails or dies does not fail the version for the others: its consumer is dropped by the producers
(lease, heartbeat), ``send_chunks`` logs its error and keeps it in ``stats["engine_errors"]``, and a restarted
engine rejoins at the next update. A version that no engine took still raises.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator

import torch
from skyrl_train.weight_sync.base import WeightChunk, WeightUpdateRequest
from skyrl_train.weight_sync.transfer_strategy import (WeightSyncInitInfo, WeightTransferReceiver,
                                                       WeightTransferSender, WeightTransferStrategy)

from ...config import GroupSettings, split_settings
from ...engine.consumer.tensor_receiver import Receiver
from ...engine.producer.producer import Producer
from ...engine.producer.producer_config import ProducerConfig, producer_options
from ...errors import MetadataMismatch, SyncError
from ...sources.stream import StepSource
from ..ray.helpers import node_address
from ...engine.protocol.messages import clip

__all__ = ["ShardsyncInitInfo", "ShardsyncTransferStrategy", "ShardsyncWeightTransferSender",
           "ShardsyncWeightTransferReceiver", "ShardsyncWeightUpdateRequest", "BACKEND"]

log = logging.getLogger(__name__)

BACKEND = "shardsync"
"""``generator.weight_sync_backend`` that selects this strategy (``enable``)."""

_RESERVED = ("rank", "n_producers", "n_consumers", "host", "coordinator")
"""Producer fields the strategy sets itself."""


def _trainer_rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@dataclass
class ShardsyncInitInfo(WeightSyncInitInfo):
    """What every inference worker needs to join: the group's settings (its token included) and its own name."""

    settings: dict[str, Any] = field(default_factory=dict)
    """``GroupSettings.to_dict()`` as trainer rank 0 runs them."""
    producer_options: dict[str, Any] = field(default_factory=dict)
    """``ProducerConfig`` fields for the trainer ranks (``lookahead``, ``source_reads``...)."""
    n_consumers: int = 1
    """Inference workers in all: SkyRL's engines × TP × PP × DP."""
    engine_index: int = 0
    device: str | None = None
    """Where a worker's receive tensors live (None: CPU; SkyRL's vLLM workers load from there)."""

    @staticmethod
    def strategy_type() -> type:
        return ShardsyncTransferStrategy

    def for_engine(self, engine_index: int, tp_size: int, pp_size: int) -> "ShardsyncInitInfo":
        return replace(self, engine_index=engine_index)

    def group_settings(self) -> GroupSettings:
        return GroupSettings.from_dict(self.settings, where="shardsync SkyRL init info")


@dataclass
class ShardsyncWeightUpdateRequest(WeightUpdateRequest):
    """One update: the version to pull and where the group's coordinator (trainer rank 0's producer) listens. The
    names, dtypes and shapes are the metadata SkyRL's request carries (SkyRL refuses an empty request)."""

    version: int = 0
    coordinator: list[Any] = field(default_factory=list)


class ShardsyncTransferStrategy(WeightTransferStrategy):
    """SkyRL's factory: init info from the config, a sender per trainer rank, a receiver per inference worker."""

    @staticmethod
    def create_init_info(cfg: Any) -> ShardsyncInitInfo:
        gen = cfg.generator
        opts = dict(gen.get("shardsync", None) or {})
        device = opts.pop("device", None)
        settings, own = split_settings(opts, where="generator.shardsync")
        producer_options(own, where="generator.shardsync", reserved=_RESERVED)  # a typo fails here, on every rank
        if not settings.token:
            settings.token = secrets.token_hex(16)
        n = int(gen.num_inference_engines) * int(gen.inference_engine_tensor_parallel_size) * int(
            gen.get("inference_engine_pipeline_parallel_size", 1)) * int(gen.get("inference_engine_data_parallel_size", 1))
        return ShardsyncInitInfo(override_existing_receiver=gen.get("override_existing_update_group", "auto") == "enable",
                                 settings=settings.to_dict(), producer_options=own, n_consumers=n, device=device)

    @staticmethod
    def create_sender(init_info: ShardsyncInitInfo, inference_client: Any) -> "ShardsyncWeightTransferSender":
        rank, world = _trainer_rank()
        if world > 1:  # every trainer rank made its own token: rank 0's is the group's
            box = [init_info]
            torch.distributed.broadcast_object_list(box, src=0)
            init_info = box[0]
        return ShardsyncWeightTransferSender(init_info, inference_client, rank=rank, n_trainers=world)

    @staticmethod
    def create_receiver(init_info: ShardsyncInitInfo) -> "ShardsyncWeightTransferReceiver":
        return ShardsyncWeightTransferReceiver(init_info)


class ShardsyncWeightTransferSender(WeightTransferSender):
    def __init__(self, init_info: ShardsyncInitInfo, inference_client: Any, *, rank: int, n_trainers: int) -> None:
        self.init_info, self.client = init_info, inference_client
        self.rank, self.n_trainers = rank, n_trainers
        self.settings = init_info.group_settings()
        self.source = StepSource(rank=rank, n_trainers=n_trainers)
        self.producer: Producer | None = None
        self.version = 0
        self.stats: dict[str, Any] = {}

    async def send_chunks(self, chunks: Iterable[WeightChunk]) -> None:
        pairs = _pairs(chunks, self.rank)
        first = self.producer is None
        if first:
            self.source.materialise(pairs)  # every rank reads every chunk: SkyRL's gathers are collectives
            self.producer = self._start()
        else:
            self.source.stream(pairs)
        version = self.version + 1
        producer = self.producer
        assert producer is not None
        serve = asyncio.to_thread(self._serve, producer, version, first)
        if self.rank == 0:
            metas = self.source.metadata()
            request = ShardsyncWeightUpdateRequest(names=[m.name for m in metas], dtypes=[m.dtype for m in metas],
                                                   shapes=[list(m.shape) for m in metas], version=version,
                                                   coordinator=list(producer.address))
            stats, engines = await asyncio.gather(serve, self._request(request))
            stats["engine_errors"] = engines
        else:
            stats = await serve
        self.version, self.stats = version, stats
        self.source.clear()
        if self.n_trainers > 1:
            torch.distributed.barrier()

    def _start(self) -> Producer:
        """The first update: rank 0's producer binds the coordinator; its address reaches the other ranks."""
        producer = Producer(self.source, self._config(None)) if self.rank == 0 else None
        address = list(producer.address) if producer is not None else None
        if self.n_trainers > 1:
            box = [address]
            torch.distributed.broadcast_object_list(box, src=0)
            address = box[0]
        return producer if producer is not None else Producer(self.source, self._config(address))

    def _config(self, coordinator: Any) -> ProducerConfig:
        return ProducerConfig(**self.settings.fields(), **self.init_info.producer_options, rank=self.rank,
                              n_producers=self.n_trainers, n_consumers=self.init_info.n_consumers, host=node_address(),
                              coordinator=coordinator)

    @staticmethod
    def _serve(producer: Producer, version: int, first: bool) -> dict[str, Any]:
        if first:
            producer.init()
        return producer.sync(version)

    async def _request(self, request: ShardsyncWeightUpdateRequest) -> list[str]:
        """Hand every engine the update; an engine's failure is logged and returned, not raised (its consumer is
        dropped by the producers; the others' version goes on)."""
        try:
            await self.client.update_named_weights(request)
            return []
        except Exception as e:  # SkyRL gathers its engines: one failure stands for whichever failed
            why = f"{type(e).__name__}: {clip(str(e), 300)}"
            log.warning("shardsync SkyRL: an inference engine failed update %d: %s", request.version, why)
            return [why]

    def teardown(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None


class ShardsyncWeightTransferReceiver(WeightTransferReceiver):
    """In an inference worker: pulls each update's groups and yields ``(name, tensor)`` as they land."""

    def __init__(self, init_info: ShardsyncInitInfo) -> None:
        self.init_info = init_info
        self.settings = init_info.group_settings()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.id = f"skyrl-engine{init_info.engine_index}-rank{rank}"
        self.receiver: Receiver | None = None
        self.coordinator: list[Any] | None = None

    def receive_weights(self, request: WeightUpdateRequest) -> Iterator[tuple[str, torch.Tensor]]:
        if not isinstance(request, ShardsyncWeightUpdateRequest):
            raise MetadataMismatch(f"{self.id}: the shardsync strategy was handed a {type(request).__name__}")
        coordinator = list(request.coordinator)
        if self.receiver is not None and coordinator != self.coordinator:  # the trainer restarted: join its group
            self.receiver.close()
            self.receiver = None
        if self.receiver is None:
            self.receiver = Receiver(self.id, coordinator, settings=self.settings, device=self.init_info.device)
            self.coordinator = coordinator
        rx = self.receiver
        rx.start(int(request.version))
        wait = self.settings.init_timeout_s + 5
        names = 0
        while (group := rx.next_group(wait)) is not None:
            for name in group:
                names += 1
                yield name, rx.tensors[name]
            wait = self.settings.timeout_s + 5
        if names != len(request):
            raise SyncError(f"{self.id}: version {request.version} brought {names} tensors, the request named "
                            f"{len(request)}")

    def teardown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def _pairs(chunks: Iterable[WeightChunk], rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    for chunk in chunks:
        if len(chunk.names) != len(chunk.tensors):
            raise MetadataMismatch(f"trainer rank {rank}: a WeightChunk names {len(chunk.names)} tensors and holds "
                                   f"{len(chunk.tensors)} ({clip(repr(chunk.names[:3]), 200)})")
        yield from zip(chunk.names, chunk.tensors)
