"""The control plane's schema: every message peers exchange, as msgspec structs of one closed union.

Payloads are msgpack-encoded (never pickle) and decoded only as one of these types (``control.py`` sends
and serves them over the authenticated framing of ``wire.py``). Who sends what:

- producers <-> coordinator: ``Join``/``Joined``, ``GetAssignments``/``Assignments``, ``ProducerReady``,
  ``SyncFailed``, ``Straggler``, ``AwaitVersion``/``Outcome``;
- consumers <-> coordinator: ``Hello``/``Welcome``, ``InitFailed``, ``RegisterPlan``/``Routes``,
  ``BeginSync``/``SyncView``, ``Completed``, ``Goodbye``; an orchestrator: ``Evict``;
- every peer's heartbeat: ``Renew``/``Lease``;
- consumers <-> producers: ``WaitReady``/``Pending``/``Ready`` (or ``Readies``), ``Released``, ``Abandon``;
- a rendezvous (how a group finds its coordinator, ``integrations/verl``): ``Lookup``/``Published``;
- any request may be answered ``Ack`` or ``Fail`` (a typed error, re-raised by the client).

Every string a peer sends is bounded where it is received: identifiers (consumer ids, sessions, node and group
names, tensor names) by a length limit checked at decode (an oversized one is a ``msgspec.ValidationError``: the
frame is refused and the connection closed); free text (reasons, errors) is clipped to ``MAX_REASON`` characters on
decode (``__post_init__``), so a long traceback still arrives, shortened, and an attacker's 90 MB reason is stored
as 2 KB. Lists a peer sends are bounded by the frame limit and, where stored, by the receiver's own tables.

A message acting for a consumer carries the session credential the coordinator issued at ``Hello``::

    payload = encode(Released(consumer="r0/tp1", session=s, version=3, group="model.layers.7"))
    msg = decode(payload)        # one of Msg, or msgspec.DecodeError
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from ...errors import TransportError

__all__ = ["MAX_ID", "MAX_REASON", "clip", "Msg", "encode", "decode", "expect", "Ack", "Fail", "Join", "Joined", "GetAssignments", "Assignments",
           "ProducerReady", "SyncFailed", "Straggler", "Hello", "Welcome", "InitFailed", "RegisterPlan", "Routes", "BeginSync",
           "SyncView", "Completed", "AwaitVersion", "Outcome", "Renew", "Lease", "WaitReady", "Pending", "Ready",
           "Readies", "SourceTable", "MAX_MORE",
           "Released", "Abandon", "Goodbye", "Evict", "Lookup", "Published"]


MAX_ID = 512
"""Longest identifier (consumer id, session, node, group, digest) a message may carry."""
MAX_NAME = 1024
"""Longest tensor name."""
MAX_REASON = 2048
"""Free text (a reason, an error) is clipped to this many characters when it is decoded (and when it is sent)."""
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Tag = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
"""A chunk's keyed tag (``chunkmac.py``): exactly 16 bytes, checked at decode."""
_TEXT = ("reason", "error", "failed")


def clip(text: str, limit: int = MAX_REASON) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    text = str(text)
    return text if len(text) <= limit else f"{text[: limit - 40]} ... [{len(text) - limit + 40} chars cut]"


class _M(msgspec.Struct, tag=True, kw_only=True):
    def __post_init__(self) -> None:
        for f in _TEXT:
            v = getattr(self, f, None)
            if isinstance(v, str) and len(v) > MAX_REASON:
                setattr(self, f, clip(v))


class Ack(_M):
    pass


class Fail(_M):
    error: str
    kind: Id = "ShardsyncError"


# ---------------------------------------------------------------- producers <-> coordinator
class Join(_M):
    rank: int
    address: list[Any]
    held: list[Name] | None
    meta_digest: Id
    node: Id = ""
    """Where this producer runs (a Ray node id, a hostname): consumers on the same node are routed to it first."""
    mac: bool = False
    """This rank runs with ``ProducerConfig.mac`` (the coordinator refuses a rank that differs from rank 0)."""


class Joined(_M):
    incarnation: int
    """Bumped each time this rank (re)joins: a restarted producer replaces its dead predecessor."""
    credential: Id = ""
    """This incarnation's secret: what it proves when it fails a version or drops a member (``SyncFailed``,
    ``Straggler``): a token holder that is no producer cannot fail versions for everyone."""


class GetAssignments(_M):
    rank: int


class Assignments(_M):
    held: list[list[str] | None]
    """Names each producer holds (None = all), by producer rank."""
    plans: list[bytes]
    routes: dict[str, dict[str, list[int]]]
    epoch: int
    """Bumped whenever a plan digest is routed after init (a rejoiner with a new plan)."""


class ProducerReady(_M):  # after (re-)registering its ring, at init (version -1) and at every sync
    rank: int
    incarnation: int
    version: int
    desc: dict[str, Any]


class SyncFailed(_M):  # producer -> coordinator: its side of a version failed
    rank: int
    version: int
    reason: str
    incarnation: int = -1
    credential: Id = ""
    """The rank's current incarnation and its ``Joined.credential``: anything else is refused (``AuthError``)."""


class Straggler(_M):  # producer -> coordinator: a live member held a group past ``straggler_s``; out of this version
    rank: int
    incarnation: int
    version: int
    consumer: Id
    session: Id
    reason: str
    credential: Id = ""
    """The producer's ``Joined.credential``."""


# ---------------------------------------------------------------- consumers <-> coordinator
class Hello(_M):
    consumer: Id
    session: Id = ""
    """The id's current session, to replace it while it is live (a consumer re-introducing itself); without it a
    Hello for a live id is refused (``SessionInUse``) until that lease lapses."""


class Welcome(_M):
    session: Id
    """This consumer's credential: every later message acting for it must carry it."""
    metadata: list[dict[str, Any]]
    held: list[list[str] | None]
    max_chunk_bytes: int
    lease_s: float


class InitFailed(_M):
    consumer: Id
    session: Id
    reason: str


class RegisterPlan(_M):
    consumer: Id
    session: Id
    plan: bytes
    node: Id = ""
    """Where this consumer runs: with a node, its plan is routed for that node (same-node producers first)."""


class Routes(_M):
    routes: dict[str, list[int]]


class BeginSync(_M):  # from a producer (rank >= 0) or a consumer (consumer != "")
    version: int
    rank: int = -1
    incarnation: int = 0
    consumer: Id = ""
    session: Id = ""


class SyncView(_M):
    version: int
    members: dict[str, list[str]]
    """consumer -> [plan digest, session]: the consumers this version is served to (fixed at its start)."""
    epoch: int
    producers: list[dict[str, Any]]
    """[{"rank", "incarnation", "address", "desc"}] ready for this version (for a producer: every rank's
    current incarnation)."""


class Completed(_M):  # consumer -> coordinator: it holds this version, every group applied
    consumer: Id
    session: Id
    version: int


class AwaitVersion(_M):  # producer -> coordinator: the version's outcome (answers within a poll slice)
    rank: int
    incarnation: int
    version: int


class Outcome(_M):
    done: bool
    """Every member completed or was dropped, or the version failed."""
    completed: list[str]
    dropped: dict[str, str]
    failed: str


class Renew(_M):  # heartbeat: a consumer (consumer, session) or a producer (rank, incarnation)
    consumer: Id = ""
    session: Id = ""
    rank: int = -1
    incarnation: int = 0


class Lease(_M):
    dead: list[list[str]]
    """[[consumer, session, reason]] of members dropped since init (lease expired, abandoned, replaced)."""
    dead_producers: dict[int, list[Any]]
    """rank -> [incarnation that died, reason] (a restarted rank's new incarnation is not dead)."""
    left: list[list[Any]]
    """[[version, consumer, session, reason]]: consumers that abandoned one version."""
    failed: dict[int, str]
    """version -> reason, for versions a producer reported failed."""


# ---------------------------------------------------------------- consumers <-> producers
MAX_MORE = 63
"""The most further groups one ``WaitReady`` may ask for (a ``Readies`` holds at most ``MAX_MORE + 1``)."""


class WaitReady(_M):
    consumer: Id
    session: Id
    version: int
    group: Id
    """A given group ("" = the next one this producer has packed for the consumer and it has not released)."""
    after: Id = ""
    """With ``group=""``: the next such group packed after this one (a consumer asks for group g+1 while it still
    reads g). Idempotent: asked again with the same ``after``, the answer is the same group."""
    sources: bool = False
    """This consumer maps the producer's memory on its own device: groups may be served from the trainer's tensors
    where they lie (``ProducerConfig.source_reads``); without it they are packed."""
    deltas: bool = False
    """This consumer reads this producer's chunks as deltas where offered (``GroupSettings.delta``): a producer
    encodes only chunks some live member reads so (the others read dense)."""
    more: Annotated[int, msgspec.Meta(ge=0, le=MAX_MORE)] = 0
    """With ``group=""``: up to this many further groups, each the next one announced after the last, answered with
    the first in one ``Readies`` where any are announced already (one round trip for groups that are all ready:
    source reads announce every group at once). 0: one ``Ready``."""


class Pending(_M):  # not packed yet: ask again (bounded server-side waits keep a stopped peer detectable)
    pass


class Ready(_M):
    version: int
    group: Id
    chunks: list[list[int]]
    """[[chunk index, offset in the producer's registered buffer, nbytes, checksum or -1], ...]."""
    tags: list[Tag] = []
    """With ``ProducerConfig.mac``: each chunk's keyed tag, in the order of ``chunks`` (the consumer checks there
    are as many); empty without."""
    deltas: list[list[int]] = []
    """With ``ProducerConfig.delta``: [[chunk index, offset, kind (1 pairs, 2 bitmap), count, base version, checksum
    of the new dense bytes, its hash (0 xxh3-64, 1 the word hash of a GPU ring)], ...] for the chunks also offered as a delta (``delta/sender.py``); at most one per
    announced chunk, each checked by the consumer before anything is read (``delta/receiver.py``)."""
    sources: bytes = b""
    """Source reads (``ProducerConfig.source_reads``): the group is not in the ring but where the trainer's tensors
    lie, as an encoded :class:`SourceTable` (the same bytes every sync while they stay put; ``chunks`` then carry
    offset -1). Decoded and checked by the consumer (``engine/source_reads/source_open.py``)."""


class Readies(_M):
    """The answer to ``WaitReady(more=n)`` when more than one group is announced: the ``Ready`` of each, in the order
    the producer announced them (each the next after the one before it), the first the one a plain ``WaitReady``
    would have named."""

    readies: Annotated[list[Ready], msgspec.Meta(min_length=2, max_length=MAX_MORE + 1)]


class SourceTable(msgspec.Struct, kw_only=True, array_like=True):
    """Where a group's full tensors lie in storages a producer shared with its colocated consumers."""

    storages: list[dict[str, Any]]
    """The transport's descriptor of each storage (``share``; opened with ``open_shared``)."""
    tensors: list[tuple[Name, int, int]]
    """[(tensor name, index in ``storages``, byte offset of the contiguous tensor in that storage)]."""


class Released(_M):
    consumer: Id
    session: Id
    version: int
    group: Id


class Abandon(_M):  # a consumer leaves one version (its engine rejected or failed it): not waited for
    consumer: Id
    session: Id
    version: int
    reason: str
    lost_producer: int = -1
    """The producer whose death made it fail: the version then fails for everyone, naming it."""


class Goodbye(_M):  # a consumer leaves for good
    consumer: Id
    session: Id


class Evict(_M):  # an orchestrator saw these consumers' engine die (Ray actor death): drop them now, not at lease end
    consumers: list[Id]
    reason: str


# ---------------------------------------------------------------- a rendezvous (a group finding its coordinator)
class Lookup(_M):  # anyone -> the rendezvous: what has been published
    pass


class Published(_M):
    coordinator: list[Any] | None
    """The coordinator's ``[host, port]`` (None: none is serving, or the old one must not be used)."""
    version: int
    """The weight version it is about to serve (or last served)."""


Msg = Union[Ack, Fail, Join, Joined, GetAssignments, Assignments, ProducerReady, SyncFailed, Straggler, Hello,
            Welcome, InitFailed, RegisterPlan, Routes, BeginSync, SyncView, Completed, AwaitVersion, Outcome, Renew, Lease,
            WaitReady, Pending, Ready, Readies, Released, Abandon, Goodbye, Evict, Lookup, Published]
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Msg)


def encode(msg: Msg) -> bytes:
    return _enc.encode(msg)


def decode(payload: bytes) -> Msg:
    """One of :data:`Msg` (``msgspec.DecodeError`` for anything else)."""
    return _dec.decode(payload)


def expect(reply: Msg, cls: type, peer: str) -> Any:
    """``reply`` if it is a ``cls``; else TransportError naming the peer, what it answered and what was expected."""
    if not isinstance(reply, cls):
        raise TransportError(f"{peer} answered {type(reply).__name__}, expected {cls.__name__}")
    return reply
