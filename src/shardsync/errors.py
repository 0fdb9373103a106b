"""Typed errors. Every message names the tensor, the rank and what was expected vs found."""

from __future__ import annotations


class ShardsyncError(Exception):
    """Base class of every error shardsync raises on purpose."""


class UnsupportedLoaderOp(ShardsyncError):
    """A weight loader did something to a checkpoint tensor that cannot be replayed as a view.

    Raised while recording a plan (at initialisation), never during a sync.
    """

    def __init__(self, *, tensor: str, op: str, chain: str, rank: int | None = None, detail: str = ""):
        self.tensor, self.op, self.chain, self.rank = tensor, op, chain, rank
        where = f" on consumer rank {rank}" if rank is not None else ""
        msg = (
            f"weight loader applied unsupported op {op!r} to checkpoint tensor {tensor!r}{where}; "
            f"op chain so far: {chain or '<none>'}"
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class PlanError(ShardsyncError):
    """A plan is malformed, does not match its metadata, or fails its consistency check."""


class MetadataMismatch(ShardsyncError):
    """Two sides disagree about tensor names, shapes or dtypes (or their digests differ)."""


class CoverageError(PlanError):
    """Destination parameters are filled only partly (or not at all) by a plan that must cover them."""


class TransportError(ShardsyncError):
    """A transfer failed or a peer did not answer within its timeout."""


class SyncError(ShardsyncError):
    """A sync could not be applied (bad input tensor, wrong version, missing data)."""


class AuthError(TransportError):
    """A peer presented a wrong token, or a session credential that is not its own."""


class SessionInUse(AuthError):
    """A ``Hello`` for a consumer id whose session is still live, without that session: refused until its lease
    lapses (a restarted engine is re-admitted then; ``Consumer.init`` waits for it)."""


class ConsumerDropped(SyncError):
    """A consumer was dropped from a sync (lease expired, it abandoned, or its session was replaced)."""


class ProducerLost(SyncError):
    """A producer (trainer rank) died or stopped answering during a sync; engines keep their last complete version."""


class NotMember(SyncError):
    """A consumer asked for a version whose membership was fixed before it (re)joined: it gets the next one."""


class ChecksumError(TransportError):
    """A pulled chunk's checksum differs from the one its producer computed (silent corruption caught)."""


class ChunkMacError(ChecksumError):
    """A pulled chunk's keyed tag (``ProducerConfig.mac``) is wrong or missing: its bytes are not the ones its producer
    packed for that producer, version, group and chunk (tampered, or replayed from elsewhere). Names all five; never
    the token or the key."""


class FrameMacError(AuthError):
    """A control frame's MAC is wrong (a frame tampered with, replayed, reordered or injected on the wire): the
    connection is closed."""


class DeltaError(SyncError):
    """Delta sync (``shardsync.delta``): a delta could not be encoded, validated or applied; the chunk's consumer
    must get the dense bytes instead."""


class DeltaFormatError(DeltaError):
    """A delta header or payload is malformed or out of bounds (wrong kind, size, count, index, bitmap).
    ``field`` names what was wrong; nothing was allocated from it or written."""

    def __init__(self, msg: str, *, field: str = ""):
        self.field = field
        super().__init__(msg)


class DeltaMismatch(DeltaError):
    """A delta does not fit what this side holds: it is against another version, or the bytes after applying it
    differ from the producer's checksum. The consumer is torn for that group; its next sync must be dense."""


class DeltaBudgetError(DeltaError):
    """The bytes the delta history must keep exceed its stated budget (raised at construction)."""

    def __init__(self, *, budget: int, need: int, what: str = "delta history"):
        self.budget, self.need = budget, need
        super().__init__(f"{what}: the served chunks need {need:,} bytes, more than the budget of {budget:,} bytes "
                         f"(raise the budget to at least {need:,}, or serve dense)")
