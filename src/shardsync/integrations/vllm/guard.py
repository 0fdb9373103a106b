"""Fail closed on torn weights: an engine whose last sync did not complete serves nothing until one does.

vLLM applies a sync layer by layer, in place. An update that stops half-way (``update_weights`` raising
after some groups were applied, ``finish_weight_update`` finding groups missing, a shutdown mid-update)
leaves the engine holding a mix of two versions. This module makes that state unobservable:

* while any worker of an engine is torn, every request the engine would serve is finished at once
  with ``finish_reason="error"``, no tokens, and ``stop_reason`` carrying the reason (which rank holds
  what); a later complete sync lifts it;
* ``LLM.get_weight_version()`` says so: ``"torn:1+2"`` (the versions the engine's weight groups hold,
  over all ranks), and the driver cannot relabel a torn engine;
* each worker's ``status_rank{R}.json`` names its ``complete_version``, ``torn``, ``holds`` and which
  groups moved on (``engine.ShardsyncEngine.sync_state``).

Which vLLM mechanism, and why (vLLM 0.32, ``vllm/v1/engine/core.py``):

* A worker-side refusal (a forward pre-hook that raises) is NOT usable: any exception from
  ``execute_model`` propagates out of ``EngineCore.step`` (core.py:674) and ``run_busy_loop``
  (core.py:1555) to ``run_engine_core``, which sends ENGINE_CORE_DEAD (core.py:1508-1513): the engine
  dies (``EngineDeadError``; observed) and could never be healed.
* Pausing (``pause_scheduler``/``sleep``, ``PauseMode`` abort|wait|keep, core.py:921 in-process and
  core.py:2061 ``EngineCoreProc``) is not either: a paused engine queues requests, so an offline
  ``LLM.generate`` waits forever, and a later ``resume`` would serve the frozen requests from the torn
  weights. vLLM's RL API pauses nothing by itself (``start/update/finish_weight_update`` are plain
  ``collective_rpc`` utilities, entrypoints/rl/offline.py:33-60, async_llm.py:1332-1355); the caller is
  expected to pause around an update.
* So the guard lives in the ENGINE CORE, the one process every request and every weight RPC passes
  through (offline ``LLM``, ``AsyncLLM`` and in-process cores alike). The plugin installs it there
  (``load_general_plugins`` runs in ``EngineCore.__init__`` before ``step_fn`` is bound, core.py:129/242):

  - ``EngineCore.collective_rpc`` (the path of ``start/update/finish_weight_update``): after every weight
    RPC, failed or not, each worker reports its ``sync_state()``; after a failed one, a window vLLM left
    open is closed on every rank (vLLM closes it only on the rank whose ``update_weights`` raised,
    gpu_worker.py:1582-1584, and not at all when ``finish_weight_update`` raised, gpu_worker.py:1587-1600,
    after which every later ``start_weight_update`` is refused as "already active" — observed — and
    nothing could heal the engine);
  - ``EngineCore.step`` / ``step_with_batch_queue``: while torn, no batch reaches the workers; every
    request in the scheduler is finished with ``FINISHED_ERROR`` (the request-scoped error vLLM itself
    uses, scheduler.py:2313-2326), so the engine stays alive, requests queued or frozen by a pause are
    failed when they would run, and nothing is served from mixed weights;
  - ``EngineCore.set_weight_version``: refused while torn (``finish_weight_update(weight_version=...)``
    sets the label only after the workers' finish succeeded, offline.py:56-60, so a complete sync has
    already cleared the torn state by then).

    # driver side, nothing to call: a torn engine answers every request like this
    out = llm.generate(prompts, params)[0].outputs[0]
    out.finish_reason == "error" and out.token_ids == [] and "TORN" in out.stop_reason
    llm.get_weight_version()            # "torn:1+2" until a sync completes
    check_outputs(llm.generate(...))    # raises TornWeightsError instead
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from ...errors import SyncError

__all__ = ["TORN_PREFIX", "HeldVersions", "TornWeightsError", "check_outputs", "describe", "install", "is_torn"]

TORN_PREFIX = "torn:"
WEIGHT_RPCS = frozenset({"init_weight_transfer_engine", "start_weight_update", "start_draft_weight_update",
                         "update_weights", "finish_weight_update", "shutdown_weight_transfer_engine"})
_MARK = "_shardsync_torn_guard"
STATE_TIMEOUT_S = 10.0
"""How long the guard waits for the workers' state after a weight RPC. A worker still busy (the driver's own
``collective_rpc`` timeout expired while it pulls) does not answer in time: the engine is then treated as torn
until a later sync completes (its outcome is unknown)."""
log = logging.getLogger("shardsync.guard")


class TornWeightsError(SyncError):
    """The engine holds a mix of two weight versions (its last sync did not complete) and refuses to serve."""


def is_torn(weight_version: str | None) -> bool:
    return bool(weight_version) and str(weight_version).startswith(TORN_PREFIX)


def describe(states: list[dict[str, Any] | None]) -> str:
    """One line naming every torn rank: which versions its groups hold, which groups left the last complete one."""
    parts = []
    for s in states:
        if s and s.get("torn"):
            moved = s.get("groups_not_at_complete_version") or []
            partial = s.get("partial_groups") or []
            parts.append(f"rank {s['rank']} holds {s['holds']} (last complete version {s['complete_version']}; "
                         f"{len(moved)}/{s['total_groups']} groups moved on: {moved[:4]}"
                         + (f"; half-written: {partial[:4]}" if partial else "")
                         + (f"; {s['reason']}" if s.get("reason") else "") + ")")
    return "; ".join(parts)


def check_outputs(outputs: list[Any]) -> list[Any]:
    """Driver helper: raise :class:`TornWeightsError` if any request was refused by a torn engine."""
    for o in outputs:
        for c in getattr(o, "outputs", []) or []:
            if c.finish_reason == "error" and isinstance(c.stop_reason, str) and "TORN" in c.stop_reason:
                raise TornWeightsError(c.stop_reason)
    return outputs


# ---------------------------------------------------------------------------------------------- workers
class HeldVersions:
    """Worker side: which version each weight group of one rank holds. Layers are written in place as groups
    arrive, so after an update that stopped half-way the groups disagree — the rank is TORN until a sync
    completes (``end(failed="")``: every group then holds the new version)::

        held.begin(); held.pending = 2
        held.writing("model.layers.0"); ...apply...; held.written("model.layers.0")
        held.end(failed="finished without groups [...]")     # held.holds() == "torn:1+2"
    """

    def __init__(self) -> None:
        self.version = 0
        """The last version this rank received completely (0: the weights it was started with)."""
        self.groups: dict[str, int] = {}
        """group -> the version it holds."""
        self.partial: set[str] = set()
        """Groups an update began to write and did not finish (their layers may hold either version)."""
        self.pending: int | None = None
        """The version the open window applies (None before its first update)."""
        self.in_window = False
        self.reason = ""

    def set_groups(self, names: Any) -> None:
        self.groups = {g: self.groups.get(g, self.version) for g in names}

    def begin(self) -> None:
        self.in_window, self.pending = True, None

    def writing(self, *groups: str) -> None:
        self.partial.update(groups)

    def written(self, group: str) -> None:
        self.groups[group] = self.pending if self.pending is not None else self.version
        self.partial.discard(group)

    def end(self, *, failed: str) -> None:
        """The window closes: complete (``failed=""``, every group was written) or not (what was written stays)."""
        complete = not failed and self.pending is not None and not self.partial
        if complete:
            self.version, self.reason = self.pending, ""
            self.groups = dict.fromkeys(self.groups, self.pending)
        self.in_window = False
        if failed and self.torn:
            self.reason = failed

    def _in_progress(self) -> bool:
        return self.in_window and (self.pending is not None and any(v == self.pending for v in self.groups.values())
                                   or bool(self.partial))

    @property
    def torn(self) -> bool:
        """Groups hold different versions, were left half-written, or belong to an open window that has written
        some (vLLM's reload is not finalised then: not servable either)."""
        return bool(self.partial) or len(set(self.groups.values())) > 1 or self._in_progress()

    def versions_held(self) -> list[int]:
        held = set(self.groups.values())
        if self.partial and self.pending is not None:
            held.add(self.pending)
        if self._in_progress():
            held.add(self.version)
        return sorted(held)

    def holds(self) -> str:
        """``"1"``, or ``"torn:1+2"`` (some groups hold version 1, others version 2)."""
        return TORN_PREFIX + "+".join(map(str, self.versions_held())) if self.torn else str(self.version)

    def state(self) -> dict[str, Any]:
        return {"complete_version": self.version, "torn": self.torn, "holds": self.holds(),
                "versions_held": self.versions_held(), "reason": self.reason if self.torn else "",
                "groups_not_at_complete_version": sorted(g for g, v in self.groups.items() if v != self.version),
                "partial_groups": sorted(self.partial), "total_groups": len(self.groups),
                "window_open": self.in_window}


def worker_sync_state(wrapper: Any, close_window: bool = False) -> dict[str, Any] | None:
    """Runs in each worker (``collective_rpc``): close an update window a failed RPC left open, then report
    the shardsync backend's state (None for other backends: the guard then stays out of the way)."""
    worker = getattr(wrapper, "worker", wrapper)
    engine = getattr(worker, "weight_transfer_engine", None)
    state = getattr(engine, "sync_state", None)
    if not callable(state):
        return None
    # also where the backend closed its window itself (a new trainer session took over one its dead owner left
    # open): vLLM's flag would refuse every later start_weight_update as "already active"
    if getattr(worker, "_weight_update_active", False) and (close_window or getattr(engine, "window_open", None)
                                                            is False):
        try:
            engine.reset_weight_update_target()  # the backend closes its window: torn if it applied anything
        finally:
            worker._weight_update_active = False
    return state()


# ---------------------------------------------------------------------------------------------- engine core
def _refresh(core: Any, method: str, failed: bool) -> None:
    try:
        states = core.model_executor.collective_rpc(worker_sync_state, timeout=STATE_TIMEOUT_S,
                                                    kwargs={"close_window": failed})
    except Exception as e:  # a worker that cannot answer may hold anything: fail closed
        states = [{"rank": "?", "torn": True, "holds": "torn:?", "versions_held": ["?"], "complete_version": "?",
                   "total_groups": "?", "reason": f"its state could not be read after {method}: {e}"}]
    if all(s is None for s in states):
        return  # not a shardsync engine
    torn = [s for s in states if s and s.get("torn")]
    was = getattr(core, "_shardsync_torn", None)
    if torn:
        committed = was["committed"] if was else getattr(core, "_weight_version", None)
        held = sorted({v for s in states if s for v in s["versions_held"]}, key=lambda v: (str(type(v)), v))
        open_window = any(s and s.get("window_open") for s in states)
        real = bool(was and was["real"]) or not open_window  # torn outside a sync in progress, at some point
        core._shardsync_torn = {"committed": committed, "states": states, "real": real,
                                "message": f"shardsync: engine holds TORN weights (a mix of versions"
                                           f"{'; a sync is in progress' if open_window else ''}) and refuses "
                                           f"to serve until a sync completes: {describe(states)}; last version "
                                           f"committed by the driver: {committed!r}"}
        core._weight_version = TORN_PREFIX + "+".join(map(str, held))
        if not was or was["message"] != core._shardsync_torn["message"]:  # mid-sync is expected: not an error
            log.log(logging.DEBUG if open_window else logging.ERROR, "%s (after %s)", core._shardsync_torn["message"],
                    method)
    elif was:
        core._shardsync_torn = None
        versions = {s["complete_version"] for s in states if s}
        core._weight_version = str(versions.pop()) if len(versions) == 1 else was["committed"]
        log.log(logging.WARNING if was["real"] else logging.DEBUG,
                "shardsync: a complete sync healed the engine (weights of version %s on every rank)",
                core._weight_version)


def _refuse_all(core: Any) -> dict[int, Any]:
    """Finish every request the scheduler holds with an error naming the torn state; nothing is executed."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    msg = core._shardsync_torn["message"]
    by_client: dict[int, list[str]] = defaultdict(list)
    for r in core.scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR):
        by_client[r.client_index].append(r.request_id)
    out = {c: EngineCoreOutputs(outputs=[EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, stop_reason=msg)
                                         for rid in ids], finished_requests=set(ids))
           for c, ids in by_client.items()}
    attach = getattr(core, "_attach_weight_version", None)  # vLLM 0.32 labels outputs; 0.26 has no versions
    if attach is not None:
        attach(out)
    return out


def serves_shardsync(core: Any) -> bool:
    """Whether this engine core was started with the shardsync backend (the guard does nothing elsewhere)."""
    from .selection import selects_shardsync

    return selects_shardsync(getattr(core, "vllm_config", None))


def install() -> None:
    """Patch vLLM's ``EngineCore`` (once per process; harmless where no engine core runs). Each patch is applied
    only where its target exists (vLLM 0.26 has no weight versions) and acts only in an engine core started with
    the shardsync backend: other engines' RPCs and steps take vLLM's own code path unchanged."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, _MARK, False):
        return
    rpc, step = EngineCore.collective_rpc, EngineCore.step
    step_bq = getattr(EngineCore, "step_with_batch_queue", None)
    set_version = getattr(EngineCore, "set_weight_version", None)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if not (isinstance(method, str) and method in WEIGHT_RPCS) or not serves_shardsync(self):
            return rpc(self, method, timeout, args, kwargs)
        try:
            out = rpc(self, method, timeout, args, kwargs)
        except BaseException:
            _refresh(self, method, failed=True)
            raise
        _refresh(self, method, failed=False)
        return out

    def guarded_step(self):
        if getattr(self, "_shardsync_torn", None):
            return _refuse_all(self), False
        return step(self)

    def guarded_step_with_batch_queue(self):
        if getattr(self, "_shardsync_torn", None):
            while self.batch_queue:  # batches launched before the update: drop their tokens
                future, _, exec_future = self.batch_queue.pop()
                for f in (future, exec_future):
                    try:
                        f.result()
                    except Exception:
                        pass
            return _refuse_all(self), False
        return step_bq(self)

    def set_weight_version(self, weight_version: str) -> None:
        torn = getattr(self, "_shardsync_torn", None)
        if torn:
            raise TornWeightsError(f"cannot label this engine {weight_version!r}: {torn['message']}")
        set_version(self, weight_version)

    EngineCore.collective_rpc = collective_rpc
    EngineCore.step = guarded_step
    if step_bq is not None:
        EngineCore.step_with_batch_queue = guarded_step_with_batch_queue
    if set_version is not None:
        EngineCore.set_weight_version = set_weight_version
    setattr(EngineCore, _MARK, True)
