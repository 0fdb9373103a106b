"""verl ``CheckpointEngine`` backend ``"shardsync"``: trainer ranks serve, rollout workers pull point-to-point.

Select it in verl's config (the module import registers it)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=shardsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=shardsync.integrations.verl

verl's per-update lifecycle, and what each call does here:

- ``prepare`` (every worker): trainer rank 0 (``is_master``) binds its rendezvous once and returns its
  address and the group's token; the others return ``{}``.
- ``build_topology`` (driver): trainer kwargs and rollout kwargs carrying each worker's role, rank, the
  group's sizes and rank 0's rendezvous.
- ``init_process_group``: records them (producers and consumers start in the first update, when the
  metadata is known; they then persist, and later updates reuse them).
- ``send_weights`` (every trainer rank, the same ``(name, full tensor)`` sequence on each): each tensor is
  served by ONE rank (``stream.owners``); rank 0 publishes the version, every rank runs ``Producer.sync``.
- ``receive_weights`` (every rollout worker): pulls each group from the rank(s) serving it and yields its
  ``(name, tensor)`` pairs as soon as the group has landed (``engine/consumer/tensor_receiver.Receiver``).
- ``finalize``: drops the update's tensor references (trainer side); connections stay up.

Engine kwargs (``checkpoint_engine.engine_kwargs.shardsync``): ``host`` (address to bind and advertise;
default: this Ray node's IP, or 127.0.0.1 outside Ray), ``device`` (receive tensors' device, default CPU), every
group setting (``shardsync.GroupSettings``: ``transport``, ``transport_kwargs``, ``timeout_s``, ``init_timeout_s``,
``lease_s``, ``verify_checksums``, ``mac``, ``delta``, ...: trainer rank 0's are the group's, handed to every
worker through the topology) and every other ``ProducerConfig`` field for the trainer ranks (``lookahead``,
``source_reads``, ...). ``bucket_size`` (verl's ``update_weights_bucket_megabytes``) is the largest chunk one pull
moves.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, AsyncGenerator, Generator

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from ...config import GroupSettings, split_settings
from ...engine.consumer.tensor_receiver import Receiver
from ...engine.producer.producer import Producer
from ...engine.producer.producer_config import ProducerConfig, producer_options
from ...errors import MetadataMismatch, SyncError
from ...sources.stream import StepSource
from ..ray.helpers import node_address
from .rendezvous import Rendezvous, lookup

__all__ = ["ShardsyncCheckpointEngine"]

_RESERVED = ("rank", "n_producers", "n_consumers", "host", "coordinator", "max_chunk_bytes")
"""Producer fields the engine sets itself (``max_chunk_bytes`` is verl's ``bucket_size``)."""


@CheckpointEngineRegistry.register("shardsync")
class ShardsyncCheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int, is_master: bool = False, *, host: str | None = None,
                 device: str | None = None, **options: Any) -> None:
        if bucket_size <= 0:
            raise ValueError(f"shardsync checkpoint engine: bucket_size must be positive, got {bucket_size}")
        self.bucket_size, self.is_master = int(bucket_size), is_master
        self.host, self.device = host, device
        self.settings, own = split_settings(options, where="shardsync checkpoint engine")
        """This worker's group settings; trainer rank 0's are the group's (``prepare`` hands them out)."""
        self.producer_options = producer_options(own, where="shardsync checkpoint engine", reserved=_RESERVED)
        """``ProducerConfig`` fields for the trainer ranks (``lookahead``, ``source_reads``, ...)."""
        if is_master and not self.settings.token:
            self.settings.token = secrets.token_hex(16)
        self.token = self.settings.token if is_master else ""
        self.rendezvous: Rendezvous | None = None
        self.topology: dict[str, Any] | None = None
        self.source: StepSource | None = None
        self.producer: Producer | None = None
        self.receiver: Receiver | None = None
        self.version = 0
        self.stats: dict[str, Any] = {}

    # ---------------------------------------------------------------- verl's topology calls
    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        if self.rendezvous is None:
            self.rendezvous = Rendezvous(host=self.host or node_address(), token=self.token)
        return {"shardsync_rendezvous": list(self.rendezvous.address), "shardsync_token": self.token,
                "shardsync_settings": {**self.settings.to_dict(), "token": ""}}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        masters = [m for m in metadata[:actor_wg_world_size] if m and "shardsync_rendezvous" in m]
        if len(masters) != 1:
            raise SyncError(f"shardsync checkpoint engine: expected exactly one trainer rank with is_master=True among "
                            f"{actor_wg_world_size} trainer ranks, found {len(masters)}")
        common = {"rendezvous": masters[0]["shardsync_rendezvous"], "token": masters[0]["shardsync_token"],
                  "settings": masters[0]["shardsync_settings"], "n_trainers": actor_wg_world_size,
                  "n_rollout": rollout_world_size}

        def side(role: str, n: int) -> dict[str, list[Any]]:
            kw: dict[str, list[Any]] = {k: [v] * n for k, v in common.items()}
            kw["role"], kw["rank"] = [role] * n, list(range(n))
            return kw

        return side("trainer", actor_wg_world_size), side("rollout", rollout_world_size)

    def init_process_group(self, *, role: str, rank: int, rendezvous: list[Any], token: str, n_trainers: int,
                           n_rollout: int, settings: dict[str, Any] | None = None) -> None:
        new = dict(role=role, rank=rank, rendezvous=list(rendezvous), token=token, n_trainers=n_trainers,
                   n_rollout=n_rollout, settings=dict(settings or {}))
        if self.topology is not None and self.topology != new:
            self._stop()  # the group changed (verl rebuilt it with other members): start over, versions go on
        self.topology = new

    def finalize(self) -> None:
        if self.source is not None:
            self.source.clear()

    # ---------------------------------------------------------------- trainer side
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None] | Any,
                           global_steps: int | None = None) -> dict[str, Any]:
        topo = self._role("trainer")
        if hasattr(weights, "__aiter__"):  # an async generator cannot be read from the serving thread
            weights = [item async for item in weights]
        self.stats = await asyncio.to_thread(self._send, iter(weights), topo)
        return {}

    def _send(self, weights: Any, topo: dict[str, Any]) -> dict[str, Any]:
        rank = topo["rank"]
        first = self.producer is None
        if first:
            self.source = StepSource(rank=rank, n_trainers=topo["n_trainers"])
            self.source.materialise(weights)
        else:
            assert self.source is not None
            self.source.stream(weights)
        if rank == 0:
            version = self.version + 1
            if first:
                self.producer = self._make_producer(topo, coordinator=None)
            assert self.rendezvous is not None and self.producer is not None
            self.rendezvous.publish(coordinator=self.producer.address, version=version)
        else:
            info = lookup(topo["rendezvous"], topo["token"], after=self.version, who=f"trainer rank {rank}",
                          timeout_s=self.settings.init_timeout_s if first else self.settings.timeout_s)
            version = int(info["version"])
            if first:
                self.producer = self._make_producer(topo, coordinator=info["coordinator"])
        assert self.producer is not None
        if first:
            self.producer.init()
        stats = self.producer.sync(version)
        self.version = version
        return stats

    def _make_producer(self, topo: dict[str, Any], coordinator: Any) -> Producer:
        assert self.source is not None
        return Producer(self.source, self.producer_config(topo, coordinator))

    def producer_config(self, topo: dict[str, Any], coordinator: Any) -> ProducerConfig:
        """A trainer rank's producer config: the group's settings (rank 0's, from the topology) and this rank's."""
        return ProducerConfig(**self.group_settings(topo).fields(), **self.producer_options, rank=topo["rank"],
                              n_producers=topo["n_trainers"], n_consumers=topo["n_rollout"],
                              host=self.host or node_address(), coordinator=coordinator,
                              max_chunk_bytes=self.bucket_size)

    @staticmethod
    def group_settings(topo: dict[str, Any]) -> GroupSettings:
        """The group's settings as trainer rank 0 runs them (its token: the topology's)."""
        return GroupSettings.from_dict({**topo["settings"], "token": topo["token"]}, where="verl topology")

    # ---------------------------------------------------------------- rollout side
    async def receive_weights(self, global_steps: int | None = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        topo = self._role("rollout")
        first = self.receiver is None
        settings = self.group_settings(topo)
        wait = settings.init_timeout_s if first else settings.timeout_s
        who = f"rollout worker {topo['rank']}"
        info = await asyncio.to_thread(lookup, topo["rendezvous"], topo["token"], after=self.version,
                                       timeout_s=wait, who=who)
        version = int(info["version"])
        if first:
            self.receiver = Receiver(f"rollout{topo['rank']}", info["coordinator"], settings=settings,
                                     device=self.device)
        rx = self.receiver
        assert rx is not None
        rx.start(version)
        while (names := await asyncio.to_thread(rx.next_group, wait + 5)) is not None:
            for name in names:
                yield name, rx.tensors[name]
        self.version = version
        self.stats = dict(rx.stats)

    # ---------------------------------------------------------------- shared
    def _role(self, role: str) -> dict[str, Any]:
        if self.topology is None:
            raise SyncError(f"shardsync checkpoint engine: {'send' if role == 'trainer' else 'receive'}_weights "
                            "before init_process_group")
        if self.topology["role"] != role:
            raise MetadataMismatch(f"shardsync checkpoint engine: this worker is a {self.topology['role']} "
                                   f"(rank {self.topology['rank']}), it cannot act as a {role}")
        return self.topology

    def _stop(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.publish(coordinator=None, version=self.version)  # nobody may find the old coordinator
        if self.receiver is not None:
            self.receiver.close()
        if self.producer is not None:
            self.producer.close()
        self.receiver = self.producer = self.source = None

    def close(self) -> None:
        """Stop this worker's producer / consumer and the rendezvous (verl has no such call: process exit does it)."""
        self._stop()
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None
