"""shardsync behind vLLM's trainer API: ``WeightTransferTrainerFactory.trainer_init(ShardsyncTrainerInitInfo(...),
client=, source=)`` then ``send_weights()`` — the same calls as vLLM's ``nccl`` backend, with the same fields
(``master_address``, ``master_port``, ``world_size``, ``rank``), so switching is a change of init-info class::

    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo   # registers "shardsync"
    info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", master_port=29600, world_size=1 + n_workers,
                                    rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ModuleSource(model))
    for step in ...:
        train_step(); engine.send_weights()        # every trainer rank, every step
    engine.shutdown()

(The engine side starts with ``weight_transfer_config={"backend": "shardsync"}``.) Every trainer rank that calls
``trainer_init`` becomes a producer: rank 0 (the sender) hosts the coordinator on ``master_address:master_port``
and drives the inference side through ``client`` (vLLM's HTTP / Ray clients, or an in-process ``LLM``); every
rank serves the bytes it holds, and each inference worker pulls exactly its own slices from them. ``trainer_init``
and the engines' ``init_weight_transfer_engine`` wait for each other, so the sender runs the client call on a
side thread. ``source`` is vLLM's ``WeightSource`` (its ``ModuleSource`` over an FSDP2 module included) or
shardsync's. ``send_weights`` returns the version's outcome (``completed``, ``dropped`` engines, seconds, bytes).

Each ``trainer_init`` is a new trainer session (``ownership``): it owns the engines while its lease is live (another
trainer is refused with ``EngineOwnedError``, naming it), a restarted trainer takes over once the old lease lapsed,
and its versions resume after ``start_version`` or, by default, after the newest version the engines hold.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo

from ...engine.protocol import messages as m
from ...engine.producer.producer import Producer
from ...engine.producer.producer_config import ProducerConfig, producer_options
from ...engine.producer.lockstep_batches import finish_lockstep
from ...config import GroupSettings, settings_of
from ...errors import SyncError
from ...sources.adapt import adapt
from . import compat
from .clients import as_client, count_workers
from .ownership import EngineOwnedError, StaleSessionError, engine_versions, resume_version, retype
from .plugin import BACKEND, register_trainer

__all__ = ["ShardsyncTrainerInitInfo", "ShardsyncTrainerEngine", "producer_config", "worker_init_info"]


@dataclass
class ShardsyncTrainerInitInfo(TrainerInitInfo, GroupSettings):
    """The trainer's init info: the group's settings (``GroupSettings``; an empty ``token`` is generated and sent to
    the other trainer ranks and the workers, every worker gets the same settings) and what concerns the trainer."""

    backend: ClassVar[str] = BACKEND

    master_address: str = "127.0.0.1"
    """Where the sender's coordinator listens (and what workers and other trainer ranks dial)."""
    master_port: int = 0
    """The coordinator's port; 0 picks a free one (then other trainer ranks learn it through torch.distributed)."""
    world_size: int = 2
    """As in ``NCCLTrainerInitInfo``: the sender plus every inference worker the client drives (all replicas,
    all TP ranks), so ``world_size - 1`` workers must register before the first sync."""
    n_producers: int | None = None
    """Trainer ranks that call ``trainer_init`` (default: torch.distributed's world size, else 1)."""
    bind_host: str | None = None
    """Interface to bind (default: ``master_address`` on the sender; elsewhere 127.0.0.1 when ``master_address``
    is a loopback address, else 0.0.0.0, advertising this machine's address)."""
    device: str | None = None
    """Where this rank's ring lives and packing runs (``"cuda:0"``, with transport ``auto``/``cuda_ipc``/``nccl``/
    ``nixl``); None: host memory (tcp)."""
    lookahead: int = 1
    straggler_s: float | None = None
    """A worker holding a version's group this long without releasing any is dropped from that version as a
    straggler (``ProducerConfig.straggler_s``; None: a few leases, at least 10 s, at most half ``timeout_s``)."""
    gather_budget_bytes: int | None = None
    delta_budget_bytes: int | None = None
    """Each trainer rank's delta history budget (``ProducerConfig.delta_budget_bytes``)."""
    recv_budget_bytes: int | None = None
    """Each inference worker's receive-buffer budget (sent to the workers)."""
    validate: bool = True
    """Workers check their recorded plan against vLLM's loaders at init."""
    direct_writes: bool = True
    """Workers write the modules whose processing their init check proves to be the identity straight into the live
    tensors (``ShardsyncInitInfo.direct_writes``)."""
    status_dir: str = ""
    """Where every worker writes its ``status_rank{R}.json`` (and plan / init files), on the engines' machines; kept
    after they stop. Empty: each engine's own folder, ``{tempdir}/shardsync-vllm/pid{P}`` (P: the pid of ``vllm
    serve`` or of the process that built the ``LLM``), removed when that process exits (``status``)."""
    start_version: int | None = None
    """Where this trainer session's versions resume: its first ``send_weights`` sends ``start_version + 1`` (e.g.
    the step of the checkpoint a restarted trainer loaded). None: after the newest version any engine holds
    (their weight versions, ``ownership.engine_versions``; 0 where the client cannot say, e.g. vLLM 0.26)."""
    producer_options: dict[str, Any] = field(default_factory=dict)
    """Any other ``ProducerConfig`` field for every trainer rank (``source_reads``, ``max_chunk_bytes``,
    ``max_routed_bytes``, ...); an unknown name is refused at ``trainer_init``."""
    # accepted for drop-in compatibility with NCCLTrainerInitInfo; shardsync sizes its buffers from the plans
    packed: bool = True
    packed_buffer_size_bytes: int = 0
    packed_num_buffers: int = 0


def producer_config(info: ShardsyncTrainerInitInfo, *, rank: int, n_producers: int) -> ProducerConfig:
    """This trainer rank's producer config: the info's group settings (its token left empty: rank 0 generates one,
    the others learn it) and its own fields."""
    loopback = info.master_address in ("localhost", "::1") or info.master_address.startswith("127.")
    # rank 0 binds the coordinator address; the others their whole machine (advertising its address) unless the
    # group is on loopback
    other = "127.0.0.1" if loopback else "0.0.0.0"
    return ProducerConfig(**{**settings_of(info).fields(), "token": ""}, rank=rank, n_producers=n_producers,
                          n_consumers=info.world_size - 1,
                          host=info.bind_host or (info.master_address if rank == 0 else other),
                          advertise_host=info.master_address if rank == 0 else None,
                          port=info.master_port if rank == 0 else 0, lookahead=info.lookahead,
                          straggler_s=info.straggler_s, gather_budget_bytes=info.gather_budget_bytes,
                          device=info.device, delta_budget_bytes=info.delta_budget_bytes,
                          **producer_options(info.producer_options, where="ShardsyncTrainerInitInfo.producer_options"))


def worker_init_info(info: ShardsyncTrainerInitInfo, *, coordinator: Any, token: str, session: str,
                     start_version: int) -> dict[str, Any]:
    """What every worker's ``init_weight_transfer_engine`` gets (``ShardsyncInitInfo``): the group's settings as the
    trainer runs them, with its token, and where and whose the group is."""
    return {**settings_of(info).to_dict(), "token": token, "coordinator": list(coordinator),
            "validate": info.validate, "direct_writes": info.direct_writes, "recv_budget_bytes": info.recv_budget_bytes, "session": session,
            "start_version": start_version, **({"plan_dir": info.status_dir} if info.status_dir else {})}


def _trainer_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _share(values: list[Any], n_producers: int) -> list[Any]:
    """Rank 0's ``values`` on every trainer rank (torch.distributed's default group; trainer-internal only)."""
    if n_producers == 1:
        return values
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise SyncError(f"{n_producers} trainer ranks need torch.distributed initialised to agree on the token and "
                        "coordinator address (or pass token= and a fixed master_port)")
    box = list(values)
    dist.broadcast_object_list(box, src=0)
    return box


class ShardsyncTrainerEngine(compat.trainer_engine_base(ShardsyncTrainerInitInfo)):  # type: ignore[misc]
    init_info_cls = ShardsyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, producer: Producer, is_sender: bool, config: Any = None):
        super().__init__(*compat.trainer_engine_init_args(config), client=client, source=source, is_sender=is_sender)
        self.producer = producer
        self.version = 0
        """The last version this session sent (its first ``send_weights`` sends ``start_version + 1``)."""
        self.session = ""
        """This trainer session's id (generated at ``trainer_init``): the engines' owner while its lease is live."""
        self.displaced = False
        """An engine refused this session (another owns it now): ``shutdown`` then leaves the engines alone."""
        self.engine_workers: int | None = None
        """The inference workers the sender's client reported at init (``clients.count_workers``; None: it could
        not say), checked against ``world_size - 1``."""

    @classmethod
    def trainer_init(cls, *args: Any, client: Any, source: Any = None, **kwargs: Any) -> "ShardsyncTrainerEngine":
        """vLLM 0.32: ``trainer_init(init_info, client=, source=)``; vLLM 0.26: ``trainer_init(config, init_info,
        client=, source=)`` (its factory passes them by keyword)."""
        compat.check_supported()
        config, init_info = compat.trainer_init_args(args, kwargs)
        if not isinstance(init_info, ShardsyncTrainerInitInfo):
            raise TypeError(f"shardsync's trainer engine takes ShardsyncTrainerInitInfo, not {type(init_info).__name__}")
        if source is None:
            raise ValueError("shardsync trainer weight transfer needs a WeightSource (vLLM's or shardsync's)")
        if init_info.world_size < 2:
            raise ValueError(f"world_size={init_info.world_size}: it counts the sender plus every inference worker")
        n_prod = init_info.n_producers or _trainer_world()
        rank = init_info.rank
        if not 0 <= rank < n_prod:
            raise ValueError(f"trainer rank {rank} outside 0..{n_prod - 1} (n_producers={n_prod})")
        cfg = producer_config(init_info, rank=rank, n_producers=n_prod)
        token = init_info.token or (secrets.token_hex(16) if rank == 0 else "")
        session = secrets.token_hex(8) if rank == 0 else ""
        client = as_client(client)
        # where this session's versions resume: what the trainer names, else after what the engines hold
        start = init_info.start_version if init_info.start_version is not None else (
            resume_version(engine_versions(client)) if rank == 0 else 0)
        # rank 0 must be listening before the others dial it: make the server first, then share its address
        producer = None
        if rank == 0:
            cfg.token = token
            producer = Producer(adapt(source), cfg)
        token, address, session, start = _share([token, producer.address if producer else None, session, start],
                                                n_prod)
        if producer is None:
            cfg.token, cfg.coordinator = token, address
            producer = Producer(adapt(source), cfg)
        engine = cls(client=client, source=source, producer=producer, is_sender=rank == 0, config=config)
        engine.version, engine.session = int(start), session
        workers = engine.engine_workers = count_workers(engine.client) if engine.is_sender else None
        if workers is not None and workers != init_info.world_size - 1:
            producer.close()
            raise ValueError(f"ShardsyncTrainerInitInfo(world_size={init_info.world_size}) counts the sender plus "
                             f"{init_info.world_size - 1} inference workers, but the engine the client drives has "
                             f"{workers}: set world_size={workers + 1}")
        if not engine.is_sender:
            producer.init()
            return engine
        payload = worker_init_info(init_info, coordinator=address, token=token, session=session,
                                   start_version=engine.version)
        # an engine-side failure (a worker that cannot start the backend; an engine another live trainer session
        # owns: EngineOwnedError, naming it) ends the producers' init at once
        try:
            engine._side(lambda: engine.client.init_weight_transfer_engine(payload), producer.init,
                         what="the inference engines' init_weight_transfer_engine", on_fail=producer.coordinator.fail)
        except BaseException as e:
            producer.close()  # a refused trainer leaves nothing behind (its coordinator's port, threads)
            err = retype(e)
            if err is e:
                raise
            raise err from e
        return engine

    def _side(self, call, main, *, what: str, on_fail=None) -> Any:
        """Run ``call`` (a client RPC that waits for the producers) on a side thread while ``main`` runs here;
        ``on_fail(err)`` runs as soon as ``call`` fails (to end ``main``'s waits)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                call()
            except BaseException as e:
                box["err"] = e
                if on_fail is not None:
                    on_fail(SyncError(f"{what} failed: {type(e).__name__}: {e}"))

        th = threading.Thread(target=run, name="shardsync-client-rpc", daemon=True)
        th.start()
        try:
            out = main()
        except BaseException:
            th.join(timeout=self.producer.cfg.lease_s)  # the workers' pulls fail within their bounds; don't hang
            if "err" in box:
                raise SyncError(f"{what} failed too: {type(box['err']).__name__}: {box['err']}")
            raise
        th.join(timeout=self.producer.cfg.timeout_s + 30)
        if th.is_alive():
            raise SyncError(f"{what} did not return within {self.producer.cfg.timeout_s + 30:.0f} s after the "
                            "producers finished")
        if "err" in box:
            raise box["err"]
        return out

    def send_weights(self, *, block: bool = True) -> dict[str, Any] | None:
        """One sync on every trainer rank: the sender drives start -> update (workers pull) -> finish.

        ``block=False`` (asynchronous RL, beyond vLLM's API): returns once this rank's lockstep gathers are done
        and the tensors it serves are copied aside (``Producer.sync(block=False)``); serving and, on the sender,
        the engines' RPCs run in the background. The next ``send_weights`` (or ``wait()``) waits for it."""
        self.wait()
        self.version += 1
        v = self.version
        if block:
            return self._send(v, lambda: self.producer.sync(v))
        pending = self.producer.sync(v, block=False)
        box: dict[str, Any] = {}

        def finish() -> None:
            try:
                box["out"] = self._send(v, pending.result)
            except BaseException as e:
                box["err"] = e

        self._async = (threading.Thread(target=finish, name=f"shardsync-send-v{v}", daemon=True), box)
        self._async[0].start()
        return None

    def wait(self) -> dict[str, Any] | None:
        """The outcome of a non-blocking ``send_weights`` still in flight (its failure raised); None if none."""
        job, self._async = getattr(self, "_async", None), None
        if job is None:
            return None
        th, box = job
        th.join(timeout=self.producer.cfg.timeout_s * 2 + 60)
        if th.is_alive():
            raise SyncError(f"a non-blocking send_weights (version {self.version}) is still running")
        if "err" in box:
            raise box["err"]
        return box["out"]

    def _send(self, v: int, result: Any) -> dict[str, Any]:
        """``result()`` serves version ``v`` (or waits for its background serving) and returns its outcome; the
        sender runs it while the engines pull (their ``update_weights`` on a side thread)."""
        if not self.is_sender:
            return result()
        try:
            self.client.start_weight_update()
        except BaseException as e:  # the engines are gone: no trainer rank may wait in a gather for this one
            self._drop_out(v, e)
            raise
        try:
            out = self._side(lambda: self.client.update_weights({"version": v, "session": self.session}), result,
                             what=f"the inference engines' update_weights (version {v})")
        except BaseException as e:
            err = retype(e)
            if err is e:
                raise
            self.displaced = isinstance(err, (EngineOwnedError, StaleSessionError))
            raise err from e
        compat.finish_weight_update(self.client, str(v))
        return out

    def _drop_out(self, v: int, e: BaseException) -> None:
        """This rank cannot serve version ``v``: fail it at the coordinator for every rank (it begins failed),
        then still run this rank's lockstep gathers, so that the other ranks leave theirs and fail ``v`` too."""
        why = m.clip(f"producer {self.producer.cfg.rank} cannot serve version {v}: {type(e).__name__}: {e}")
        try:
            self.producer.client.call(self.producer.sync_failed(v, why), timeout_s=5)
        except Exception:
            pass  # the coordinator is gone too: the others fail on it within their lease
        finish_lockstep(iter(self.producer.source.iter_groups()))

    def shutdown(self) -> None:
        try:
            self.wait()
        except Exception:
            pass  # reported where it failed; shutting down goes on
        if self.is_sender and not self.displaced:  # a displaced session must not release its successor's engine
            stop = getattr(self.client, "shutdown_weight_transfer_engine", None)
            if callable(stop):
                try:
                    stop()
                except Exception:
                    pass  # best effort: the engines may be gone already
        self.producer.close()


register_trainer()
