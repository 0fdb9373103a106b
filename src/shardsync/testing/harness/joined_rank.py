"""A trainer rank that joins a real process group before its source exists, and the producer served over one.

    class MyRank(JoinedRank):      # metas known at once; _source() built on first use, after join_group(...)
        ...
    producer = serve(source, **cfg)   # a Producer (not yet init()-ed), or one inside a Ray actor with group=
"""

from __future__ import annotations

from typing import Any


def serve(source: Any, *, group: str | None = None, **cfg: Any):
    """The producer over ``source`` (not yet ``init()``-ed): ``ProducerConfig(**cfg)`` here, or, with ``group``,
    inside a Ray actor through the group's registry (``integrations.ray.start_producer``)."""
    if group is not None:
        from ...integrations.ray import start_producer

        return start_producer(source, group=group, **cfg)
    from ...engine.producer.producer import Producer, ProducerConfig

    return Producer(source, ProducerConfig(**cfg))


class JoinedRank:
    """A rank of a real trainer: its source exists once it has joined the trainer's process group (``_source()``,
    on first use); the metadata is known before."""

    metas: list

    def _source(self) -> Any:
        raise NotImplementedError

    def metadata(self):
        return self.metas

    def held_names(self):
        return self._source().held_names()

    def groups(self):
        return self._source().groups()

    def iter_groups(self):
        return self._source().iter_groups()


def join_group(spec: dict, rank: int, n: int) -> None:
    """Join the trainer's gloo group (``spec["dist_port"]``) as ``rank`` of ``n``."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['dist_port']}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=120))
