"""The ``shardsync`` vLLM weight-transfer backend (runs inside every vLLM worker), in pull mode.

Driver side, with vLLM's own RL API (or ``trainer_backend``, which sends the same calls)::

    llm = LLM(model=..., weight_transfer_config={"backend": "shardsync"})
    llm.init_weight_transfer_engine({"init_info": {"coordinator": [host, port], "token": token}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": v}})    # every worker pulls its own slices
    llm.finish_weight_update(weight_version=str(v))

``coordinator``/``token`` name producer 0's control server; each worker registers its plan with the producers
and ``update_weights`` makes every worker pull its own slices from the producers that hold them, in parallel
with the trainer ranks' ``Producer.sync(v)``. ``{"inspect_to": dir, "check_fresh": checkpoint}`` as init info
instead compares what each worker holds with a fresh load of ``checkpoint`` (``fresh_check``; read-only).

At ``init_transfer_engine`` each worker records its plan by a dry run of the model's own
``load_weights`` (live weights untouched), checks it against the real loaders on random data
(``validate``), checks each layer kind's processing against a first load (``processor``), and writes
the plan as JSON. A sync writes each received group's slices straight into the live tensors of the modules
whose first-load processing the init check proved to be the identity (``layerwise.direct_modules``: on a GPU, an
unquantized model's every layer), and into vLLM's layerwise buffers for the others, whose FIRST-LOAD processing
(``first_load``) is replayed as soon as a layer is complete, so that the engine holds what a fresh engine loaded
from the same weights holds.

Torn updates (fail closed): an update that stops half-way (``update_weights`` raising after some groups were
applied, groups missing at ``finish_weight_update``, a shutdown mid-update) leaves this rank TORN. Each rank tracks
the version every group holds (``partial`` mid-apply) in ``sync_state()`` and ``status_rank{R}.json`` (``torn``,
``holds`` e.g. ``"torn:1+2"``); the engine core's ``guard`` refuses every request until a later sync completes on
every rank. ``version`` only advances on a complete sync, so a failed version may be retried.

Ownership (``ownership``): the trainer session of the last init owns the engine. Another session's init is refused
at once (``EngineOwnedError``, naming the owner's coordinator) while the owner's lease is live, and takes the engine
over once it lapsed (a crashed, killed or preempted trainer; a clean exit releases it at once); an update of another
session is refused (``StaleSessionError``); the new session's versions start after its ``start_version``, and its
first complete sync heals a torn engine.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ...config import GroupSettings, resolve_aliases, settings_of
from ...errors import SyncError
from ...plan.split import split_to_budget
from ...types import metadata_digest
from .compat import check_supported
from .plugin import require_plugin
from .fresh_check import fresh_check
from .guard import HeldVersions
from .ownership import STALE_MARK, Owner, StaleSessionError, wait_owner_gone
from .layerwise import (LayerApplier, begin_reload, check_processing, record_vllm_plan, reloaded_modules,
                        refuse_rebind_under_cuda_graphs, validate_plan, vllm_context)
from .processor import FreshProcessor

log = logging.getLogger("shardsync.vllm")

SHUTDOWN_BOUND_S = 2.0
"""The most ``shutdown`` waits for the consumer to close: vLLM gives a worker 5 s before SIGTERM/SIGKILL, and an
in-process engine shuts down inside the driver's exit; a goodbye to silent producers must hold neither."""


@dataclass
class ShardsyncInitInfo(WeightTransferInitInfo, GroupSettings):
    """A worker's init info: the group's settings (``GroupSettings``: token, transport, timeouts, checksums, mac,
    delta, ...; the trainer backend sends its own) and what concerns this engine."""

    plan_dir: str = ""
    """Where each worker writes ``plan_rank{R}.json`` (and its init / status files). Default: the engine's own folder,
    ``{tempdir}/shardsync-vllm/pid{P}`` (P: the pid of the process that started the engine), removed when that
    process exits (``status``)."""
    validate: bool = True
    """Check the recorded plan against the real loaders on random data, and each layer kind's processing
    against a first load (scratch tensors). Without it every layer is processed in ``rebind`` mode."""
    consumer: str = ""
    coordinator: list[Any] | None = None
    """Address [host, port] of producer 0's control server. Workers learn the metadata from it, register
    their plans, and pull every sync from the producers (no data through the driver)."""
    direct_writes: bool = True
    """Write the modules whose first-load processing the init check proves to be the identity (``KindReport.direct``,
    ``layerwise.direct_modules``) straight into their live tensors: no layerwise buffer, no processing replay. Off:
    every module takes the general path (buffers, then first-load processing)."""
    recv_device: str = "auto"
    """Where the receive slots live. ``auto``: the worker's GPU when it has one and the transport moves
    GPU memory (anything but ``tcp``), else host memory; ``cpu``; or a device such as ``cuda:0``."""
    replica: str = ""
    """This engine's replica id (consumers are ``{replica}/rank{R}``); default ``vllm-{instance id}``, unique per
    engine, so one init payload can go to several replicas (vLLM's Ray client fans out)."""
    session: str = ""
    """The trainer session this init comes from (``ShardsyncTrainerEngine`` generates one at ``trainer_init``): with
    its coordinator's address it names the engine's owner; an init of another session is refused while the owner's
    lease is live and takes the engine over once it lapsed (``ownership``)."""
    start_version: int | None = None
    """The session's first version must be newer than this (the trainer's checkpoint step, or the engines' own
    version); later ones newer than the last complete one. None: newer than the last complete version."""
    recv_budget_bytes: int | None = None
    """The most bytes this worker's receive buffers may take (at least two of its largest groups)."""
    inspect_to: str = ""
    """With ``check_fresh``: the directory each worker writes ``fresh_rank{R}.json`` to."""
    check_fresh: str = ""
    """With ``inspect_to``: only compare what the engine holds with a fresh load of this checkpoint directory
    (vLLM's model loader on this worker's config, ``fresh_check.fresh_check``) and write the outcome to
    ``{inspect_to}/fresh_rank{R}.json``; no plan, engine state untouched."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.inspect_to and not self.check_fresh:
            raise ValueError("shardsync init_info: 'inspect_to' needs 'check_fresh' (the checkpoint to compare "
                             "the engine with; writing every tensor to files is test scaffolding, "
                             "shardsync.testing.vllm)")
        if not self.inspect_to and self.coordinator is None:
            raise ValueError("shardsync init_info needs 'coordinator' (producer 0's control address) and 'token'")


@dataclass
class ShardsyncUpdateInfo(WeightTransferUpdateInfo):
    version: int = 0
    """The version to pull: every worker pulls its slices of it from the producers."""
    session: str = ""
    """The trainer session that sends it: an update of a session that does not own the engine (a displaced trainer,
    a replayed request) is refused before anything is applied. Empty: not checked (shardsync's own API)."""


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _recv_device(info: ShardsyncInitInfo, worker_device: Any) -> str | None:
    if info.recv_device == "cpu":
        return None
    if info.recv_device != "auto":
        return info.recv_device
    dev = torch.device(worker_device) if worker_device is not None else torch.device("cpu")
    return str(dev) if dev.type == "cuda" and info.transport != "tcp" else None


class ShardsyncEngine(WeightTransferEngine[ShardsyncInitInfo, ShardsyncUpdateInfo]):
    init_info_cls = ShardsyncInitInfo

    def parse_init_info(self, init_dict: dict[str, Any]) -> ShardsyncInitInfo:
        """vLLM's parse, with the settings' old names (``config.ALIASES``: ``require_mac``) still accepted."""
        return super().parse_init_info(resolve_aliases(dict(init_dict), where="shardsync init_info"))
    update_info_cls = ShardsyncUpdateInfo
    supports_draft_weight_update = False

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:  # abstract in vLLM 0.26, gone in 0.32
        raise NotImplementedError("shardsync's trainer side is its trainer backend (ShardsyncTrainerInitInfo) or "
                                  "shardsync.Producer; workers pull, nothing is pushed from a static method")

    def __init__(self, config, vllm_config, device, model) -> None:
        check_supported()
        require_plugin()
        super().__init__(config, vllm_config, device, model)
        self.rank = _rank()
        self.plan = None
        self.consumer = None
        self.last_status: dict[str, Any] = {}
        """What the last window (or init) reported: the status file's content (``seconds``: the update window)."""
        self.applier: LayerApplier | None = None
        self.live_base: Any = None
        """Delta sync: the directly written tensors a delta's base is read back from (no held copy of them)."""
        self.processor: FreshProcessor | None = None
        self.direct: list[str] = []
        """Modules a sync writes straight into their live tensors (``layerwise.direct_modules``)."""
        self.not_direct: dict[str, str] = {}
        """The other written modules (layerwise buffers + first-load processing), each with why."""
        self.reloaded: list[str] = []
        """The modules each window hands to vLLM's layerwise reload (``layerwise.reloaded_modules``)."""
        self.held = HeldVersions()
        """Which version each weight group holds: torn or not, and the last complete version."""
        self.plan_dir = ""
        self._applied: set[str] = set()
        self._op = "sync"
        self._bytes, self._wire, self._t0 = 0, {}, 0.0
        self._started = self._received = False
        self._peer_failed = False
        self.owner: Owner | None = None
        """The trainer session whose coordinator this worker's consumer belongs to (None: none; driver push)."""
        self._floor: int | None = None
        """The session's ``start_version`` until its first complete sync (versions must be newer than it)."""

    # ---------------------------------------------------------------- init
    def init_transfer_engine(self, init_info: ShardsyncInitInfo) -> None:
        if init_info.inspect_to:  # read-only: what this engine holds vs a fresh load of a checkpoint
            os.makedirs(init_info.inspect_to, exist_ok=True)
            out = fresh_check(self.model, self.vllm_config, init_info.check_fresh, rank=self.rank)
            _write_json(os.path.join(init_info.inspect_to, f"fresh_rank{self.rank}.json"), out)
            return
        t0 = time.perf_counter()
        owner = Owner.of(init_info) if init_info.coordinator is not None else None
        if owner is not None:
            self._take_over(owner)
        replica = init_info.replica or f"vllm-{getattr(self.vllm_config, 'instance_id', '') or 'r0'}"
        consumer = init_info.consumer or f"{replica}/rank{self.rank}"
        if not init_info.plan_dir:  # no engine core assigned one (``status``): this engine's folder, by replica
            from .status import default_root
            init_info.plan_dir = os.path.join(default_root(), replica.replace('/', '_'))
        found: dict[str, Any] = {}

        def record(metas):
            found["metas"] = metas
            plan = record_vllm_plan(self.model, self.vllm_config, metas, rank=self.rank, consumer=consumer)
            found["record_s"] = time.perf_counter() - t0
            found["checked"] = validate_plan(self.model, self.vllm_config, metas, plan, rank=self.rank) \
                if init_info.validate else 0
            # before the plan is registered: a refusal here fails the group's init (the producers learn the reason)
            found["processing"] = check_processing(self.model, self.vllm_config, plan, rank=self.rank,
                                                   validate=init_info.validate)
            refuse_rebind_under_cuda_graphs(self.vllm_config, found["processing"][1], plan, init_info.validate,
                                             self.rank)
            # checked whole; registered in parts of the sync's memory budget (a module is processed once all
            # the parts writing it are applied: LayerApplier)
            return split_to_budget(plan, metas, init_info.sync_memory_bytes)

        self.plan = self._find_plan(init_info, consumer, record)
        if owner is not None:
            self.owner, self._floor = owner, init_info.start_version
        metas, record_s, checked = found["metas"], found["record_s"], found["checked"]
        aliases, kinds, direct = found["processing"]
        if not init_info.direct_writes:
            direct = {m: "direct_writes=False" for m in direct}
        self.processor = FreshProcessor(self.model, dtype=self.model_config.dtype, aliases=aliases,
                                        modes={k: r.mode for k, r in kinds.items()})
        self.direct = sorted(m for m, why in direct.items() if not why)
        self.not_direct = {m: why for m, why in direct.items() if why}
        self.reloaded = reloaded_modules(self.model, self.plan, self.direct, aliases)
        self.applier = LayerApplier(self.model, self.plan, direct=self.direct)
        delta = self.consumer is not None and self.consumer.delta  # (no consumer: the inspect-only path)
        self.live_base = self.applier.read_back(keep_out=self.reloaded) if delta else None
        self.held.set_groups(g.name for g in self.plan.groups)  # a re-init keeps what each group holds
        self.plan_dir = init_info.plan_dir
        os.makedirs(self.plan_dir, exist_ok=True)
        with open(os.path.join(self.plan_dir, f"plan_rank{self.rank}.json"), "wb") as f:
            f.write(self.plan.to_json())
        _write_json(os.path.join(self.plan_dir, f"init_rank{self.rank}.json"), {
            "rank": self.rank, "digest": self.plan.digest, "meta_digest": metadata_digest(metas),
            "record_s": record_s, "init_s": time.perf_counter() - t0, "validated_tensors": checked,
            "plan_bytes": self.plan.nbytes, "unneeded": len(self.plan.unneeded),
            "processing": {k: r.to_dict() for k, r in kinds.items()},
            "direct_modules": len(self.direct), "general_modules": len(self.not_direct),
            "reloaded_modules": len(self.reloaded), "modules": sum(1 for _ in self.model.modules()),
            "not_direct": _why_not(self.not_direct),
            "tied": {m: {n: ".".join(p) for n, p in hits.items()} for m, hits in aliases.items()}})
        self._write_status({"op": "init", "missing_groups": []})

    def _take_over(self, new: Owner) -> None:
        """Before ``new``'s consumer joins: refuse it while another session's owner is live
        (``ownership.EngineOwnedError``), else close what the previous session left (its consumer, bounded; an
        update window it left open, torn if it had applied groups)."""
        old, consumer = self.owner, self.consumer
        if consumer is not None and old is not None and old != new:
            wait_owner_gone(consumer, old, new, rank=self.rank)
            log.warning("rank %d: %s is gone (its lease lapsed); %s takes this engine over (it holds %s)", self.rank,
                        old, new, self.held.holds())
        if self._started:  # vLLM's flag for it is cleared by the guard (``window_open`` is False now)
            self._abort(f"{old or 'the previous trainer session'} left this update window open")
        if consumer is not None:
            self.consumer, self.owner, self._floor = None, None, None
            _close_bounded(consumer, goodbye=old == new and not self._peer_failed, rank=self.rank)

    def _find_plan(self, init_info: ShardsyncInitInfo, consumer: str, record) -> Any:
        """This worker's plan: recorded (``record(metas)``) against the metadata the coordinator serves and
        registered with the producers by the consumer, which then pulls every sync."""
        from ...engine.consumer.consumer import Consumer

        self.consumer = Consumer(consumer, init_info.coordinator, record=record, apply=self._apply,
                                 settings=settings_of(init_info), recv_budget_bytes=init_info.recv_budget_bytes,
                                 device=_recv_device(init_info, self.device), read_back=self._read_back)
        try:
            return self.consumer.init()
        except BaseException:  # no half-connected consumer (heartbeat, sockets) outlives a failed init
            consumer_obj, self.consumer = self.consumer, None
            _close_bounded(consumer_obj, goodbye=False, rank=self.rank)
            raise

    # ---------------------------------------------------------------- update lifecycle
    def start_weight_update(self) -> None:
        if self.applier is None or self.processor is None:
            raise SyncError(f"rank {self.rank}: start_weight_update before init_weight_transfer_engine")
        if self._started:
            raise SyncError(f"rank {self.rank}: start_weight_update called twice without finish_weight_update")
        self.applier.begin()
        self.processor.begin(self.reloaded)  # exact live tensor slots, vLLM's per-layer processing -> first-load replay
        try:
            begin_reload(self.model, self.reloaded)  # the others (direct or not written) keep their live tensors
        except BaseException:
            self.processor.end()
            raise
        self._started, self._received = True, False
        self._applied.clear()
        self.held.begin()
        self._bytes, self._wire = 0, {}
        self._op = "sync"
        self._t0 = time.perf_counter()

    def update_weights(self, update_info: dict) -> None:  # the base class syncs an accelerator (absent on CPU)
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def _read_back(self, plan: Any) -> Any:
        """The consumer's ``read_back``: the live base judged at init, for the plan it was judged on."""
        base = self.live_base
        return base if base is not None and base.plan is plan else None

    def _apply(self, group: str, buf: torch.Tensor) -> None:
        """Scatter one group into the layerwise buffers and process the layers it completes (on the
        consumer's apply thread)."""
        assert self.applier is not None
        self.held.writing(group)  # until it is applied, a failure leaves this group half-written
        with vllm_context(self.vllm_config):
            self.applier.apply(group, buf)
        self.held.written(group)
        self._applied.add(group)
        self._bytes += self.applier.layouts[group].nbytes

    def receive_weights(self, info: ShardsyncUpdateInfo) -> None:
        if self.plan is None or self.applier is None or self.consumer is None:
            raise SyncError(f"rank {self.rank}: update_weights before init_weight_transfer_engine")
        if not self._started or self._received:
            # outside a start/finish window the layers are live kernel tensors, not checkpoint-format buffers
            raise SyncError(f"rank {self.rank}: update_weights needs start_weight_update first, and one pull per "
                            "start/finish window")
        self._received = True
        if info.session and self.owner is not None and info.session != self.owner.session:
            # never told to the producers: this worker's consumer belongs to the owner's group, not the sender's
            raise StaleSessionError(f"rank {self.rank}: update version {info.version} of trainer session "
                                    f"{info.session!r} {STALE_MARK} ({self.owner}); nothing was applied")
        try:  # pull every group from the producers
            self._check_newer(info.version)
        except SyncError as e:  # the producers stop waiting for this worker at once, told why
            self.consumer.abandon(info.version, str(e))
            raise
        self.held.pending = info.version
        try:
            pulled = self.consumer.sync(info.version)
            self._wire = {k: v for k, v in pulled.items() if k == "bytes_received" or k.startswith("delta_")}
        except BaseException:
            self._peer_failed = True  # its producers may not answer: shutdown says no goodbye
            raise
        self._peer_failed = False

    def _check_newer(self, version: int) -> None:
        if self._floor is not None:  # a session's first version: newer than where it said it starts
            if version <= self._floor:
                raise SyncError(f"rank {self.rank}: update version {version} is not newer than the start version "
                                f"{self._floor} of trainer session {self.owner.session if self.owner else ''!r}")
            return
        if version <= self.held.version:
            raise SyncError(f"rank {self.rank}: update version {version} is not newer than the last complete "
                            f"version {self.held.version}")

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.plan is None or self.processor is None:
            raise SyncError(f"rank {self.rank}: finish_weight_update before init_weight_transfer_engine")
        self._started = False
        missing = self._missing_groups()
        if self.held.pending is None:  # a window without any update: nothing applied, nothing changes
            missing = []
        try:
            with vllm_context(self.vllm_config):
                finalize_layerwise_reload(self.model, self.model_config)
        except BaseException as e:
            self.held.end(failed=f"finish_weight_update failed: {e}")
            raise
        finally:
            self.processor.end()
        self.held.end(failed=f"finished without groups {missing[:5]} ({len(missing)} missing)" if missing else "")
        if self.held.pending is not None and self.held.version == self.held.pending:
            self._floor = None  # complete: later versions must be newer than this one
        self._write_status({"op": self._op, "missing_groups": missing, "seconds": time.perf_counter() - self._t0,
                            "processed_modules": len(self.processor.processed),
                            "direct_modules": len(self.direct), "general_modules": len(self.not_direct),
                            # the consumer's apply thread: scatters (+ processing replay on the general path)
                            "apply_s": (self.consumer.stats.get("apply_s", 0.0) if self.consumer else 0.0)
                            if self.held.pending is not None else 0.0,
                            "rebound_modules": len(self.processor.rebound),
                            # what crossed the wire (with delta sync: payloads + dense reads), and the delta counters
                            "wire": self._wire})
        if missing:
            raise SyncError(f"rank {self.rank}: sync of version {self.held.pending} finished without groups "
                            f"{missing[:5]} ({len(missing)} missing): " + (
                                f"the engine holds TORN weights ({self.held.holds()}) and refuses to serve until a "
                                "later sync completes" if self.held.torn else
                                f"nothing was applied, the engine keeps version {self.held.version}"))

    def _missing_groups(self) -> list[str]:
        """The plan's groups this window did not apply."""
        assert self.plan is not None
        return [g.name for g in self.plan.groups if g.name not in self._applied]

    def reset_weight_update_target(self) -> None:
        """vLLM calls this after a failed start/update (and after every finish; the guard calls it after a
        failed finish, and on every rank after a failed update): a window left open by a failure is closed
        here — every layer not yet applied gets its live tensors back, the next start_weight_update works —
        and if some layers were already applied this rank is TORN, which the guard refuses to serve."""
        super().reset_weight_update_target()
        if self._started:
            self._abort("the update failed before finish_weight_update")

    def _abort(self, why: str) -> None:
        self._started = False
        if self._applied and self.plan is not None and not self._missing_groups():
            self.held.writing(*self._applied)  # every group applied, vLLM's reload never finalised: not servable
        self.held.end(failed=why)
        if self.processor is not None and self.processor.open:
            self.processor.end()
        if self.plan is not None and self.plan_dir:
            missing = [g.name for g in self.plan.groups if g.name not in self._applied]
            self._write_status({"op": self._op, "missing_groups": missing, "aborted": why,
                                "seconds": time.perf_counter() - self._t0})

    @property
    def window_open(self) -> bool:
        """An update window (start .. finish) is open on this rank (the guard closes vLLM's when this is False)."""
        return self._started

    @property
    def version(self) -> int:
        """The last version this rank received COMPLETELY (0: the weights it was started with)."""
        return self.held.version

    def sync_state(self) -> dict[str, Any]:
        """What this rank holds (read by the engine core's guard after every weight RPC)."""
        return {"rank": self.rank, **self.held.state()}

    def _write_status(self, extra: dict[str, Any]) -> None:
        status = {"rank": self.rank, "version": self.held.pending if self.held.pending is not None else self.version,
                  "bytes_received": self._bytes, **self.sync_state(), "inconsistent": self.held.torn, **extra}
        self.last_status = status
        if self.plan_dir:
            _write_json(os.path.join(self.plan_dir, f"status_rank{self.rank}.json"), status)

    def shutdown(self) -> None:
        """Bounded (``SHUTDOWN_BOUND_S``): after a failed pull the producers may be gone or stalled, and a
        goodbye that waited for them kept an in-process engine's driver from exiting (~30 s per stalled peer
        connection) and outlasted vLLM's grace for a worker process (which is then killed, not shut down)."""
        if self._started:
            self._abort("shutdown during an update")
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            _close_bounded(consumer, goodbye=not self._peer_failed, rank=self.rank)
        self.applier = self.live_base = None
        self.processor = None
        self.plan = None
        self.owner, self._floor = None, None


def _why_not(direct: dict[str, str], most: int = 64) -> dict[str, list[str]]:
    """Modules not written directly, by reason (at most ``most`` names per reason)."""
    out: dict[str, list[str]] = {}
    for m, why in sorted(direct.items()):
        if len(out.setdefault(why[:200], [])) < most:
            out[why[:200]].append(m)
    return out


def _close_bounded(consumer: Any, *, goodbye: bool, rank: int, bound_s: float = SHUTDOWN_BOUND_S) -> bool:
    """``consumer.close()`` on a daemon thread, waited for at most ``bound_s``: True if it finished. What it
    still waits on (a peer that does not answer) ends with its own timeouts or with the process."""
    done = threading.Event()

    def run() -> None:
        try:
            consumer.close(goodbye=goodbye)
        except Exception as e:  # closing is best effort: the process is going away or the sync failed
            log.warning("rank %d: closing the shardsync consumer failed: %s", rank, e)
        finally:
            done.set()

    threading.Thread(target=run, name=f"shardsync-close-rank{rank}", daemon=True).start()
    if not done.wait(bound_s):
        log.warning("rank %d: the shardsync consumer did not close within %.1f s (a producer does not answer); "
                    "not waiting for it", rank, bound_s)
        return False
    return True
