"""No torn version is ever served (real vLLM, CPU build).

``HeldVersions`` (which version each weight group of a rank holds) is checked on a table first. Then one
engine (tiny Qwen3, TP1, the testing engine's driver push: metadata in init_info, packed groups pushed in
update_info) is shared by the first tests, which run in order and build on each other's state:

1. a complete sync is served and named;
2. an update refused before it applied anything leaves the engine serving its version;
3. a finish with groups missing leaves it TORN: every request fails with the reason, the version says
   ``torn:1+2``, the driver cannot relabel it, and the engine process stays alive;
4. an update that raises half-way moves other groups: still torn (``torn:1+2+3``), still refusing;
5. a complete sync heals it: served again, equal (every tensor, probe outputs, greedy tokens) to a fresh
   engine started on the same weights.

Then a driver whose pull failed against a producer that stopped answering exits promptly and leaves no
process behind (an in-process engine: the backend's shutdown runs inside the driver's exit).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest

from shardsync.plan.groups import base_group

from shardsync.verify.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
from shardsync.integrations.vllm.guard import HeldVersions, TornWeightsError, check_outputs
from shardsync.verify.reference import (PROMPT, compare_with, cpu_env, engine_kwargs,
                                                           fresh_reference, inspect_engine, shutdown)
from shardsync.verify.push import pack_updates, read_plans
from shardsync.source import ModuleSource

vllm = pytest.mark.vllm  # the engine tests; the first one is pure


GROUPS = ["pre", "model.layers.0", "model.layers.1", "post"]


@pytest.mark.parametrize("steps,holds,moved", [
    ([("sync", 1, GROUPS, "")], "1", []),
    ([("sync", 1, GROUPS, ""), ("sync", 2, GROUPS[:2], "missing")], "torn:1+2", ["model.layers.0", "pre"]),
    ([("sync", 1, GROUPS, ""), ("sync", 2, [], "failed before any group")], "1", []),
    ([("sync", 1, GROUPS, ""), ("sync", 2, GROUPS[:2], "x"), ("sync", 3, GROUPS[2:3], "x")], "torn:1+2+3",
     ["model.layers.0", "model.layers.1", "pre"]),
    ([("sync", 1, GROUPS, ""), ("sync", 2, GROUPS[:2], "x"), ("sync", 3, GROUPS, "")], "3", []),
    ([("sync", 1, GROUPS, ""), ("half", 2, GROUPS[:1], "raised mid-group")], "torn:1+2", []),
])
def test_held_versions(steps, holds, moved) -> None:
    h = HeldVersions()
    h.set_groups(GROUPS)
    for kind, version, groups, failed in steps:
        h.begin()
        h.pending = version
        for g in groups:
            h.writing(g)
            if kind != "half":
                h.written(g)
        if groups and not failed:
            assert h.torn and h.holds().startswith("torn:")  # an open window that wrote something is not servable
        h.end(failed=failed)
    st = h.state()
    assert (h.holds(), st["groups_not_at_complete_version"]) == (holds, moved), st
    assert st["torn"] == holds.startswith("torn:") and st["reason"] == (steps[-1][3] if st["torn"] else "")
    assert st["partial_groups"] == (steps[-1][2] if steps[-1][0] == "half" else [])


def live_children(pid: int) -> list[int]:
    """Descendants of ``pid`` that are running (zombies, already dead, are left out)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out += [int(p), *live_children(int(p))]
    return out


def engine_processes(pid: int) -> list[int]:
    """vLLM's engine core and workers among ``pid``'s descendants (they name themselves ``VLLM::...``)."""
    out = []
    for p in live_children(pid):
        try:
            if open(f"/proc/{p}/comm").read().startswith("VLLM::"):
                out.append(p)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return build_tiny_checkpoint("qwen3", str(tmp_path_factory.mktemp("ckpt") / "qwen3"))


@pytest.fixture(scope="module")
def eng(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("torn")
    cpu_env(1)
    from vllm import LLM

    llm = LLM(**engine_kwargs(ckpt, 1, False))
    base = load_checkpoint(ckpt)
    plan_dir = str(root / "plans")
    metas = ModuleSource(perturb(base, 1)).metadata()
    llm.init_weight_transfer_engine({"init_info": {"metadata": [m.to_dict() for m in metas], "plan_dir": plan_dir}})
    ns = SimpleNamespace(llm=llm, ckpt=ckpt, base=base, plan_dir=plan_dir, plans=read_plans(plan_dir, 1), root=root,
                         engine_pids=engine_processes(os.getpid()), tokens={})
    assert ns.engine_pids, "the engine core and its worker run as child processes"
    yield ns
    if ns.llm is not None:
        shutdown(ns.llm)


def updates(eng, version: int) -> list[dict]:
    return pack_updates(eng.plans, ModuleSource(perturb(eng.base, version)), version=version)


def status(eng) -> dict:
    with open(os.path.join(eng.plan_dir, "status_rank0.json")) as f:
        return json.load(f)


def ask(llm):
    from vllm import SamplingParams

    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)


def assert_refused(eng, holds: str) -> None:
    out = ask(eng.llm)[0].outputs[0]
    assert out.finish_reason == "error" and list(out.token_ids) == [], (out.finish_reason, out.token_ids)
    assert "TORN" in out.stop_reason and f"rank 0 holds {holds}" in out.stop_reason, out.stop_reason
    with pytest.raises(TornWeightsError, match=re.escape(f"rank 0 holds {holds}")):
        check_outputs(ask(eng.llm))
    assert eng.llm.get_weight_version() == holds
    with pytest.raises(Exception, match="TORN"):  # the driver cannot label a torn engine as some version
        eng.llm.update_weight_version("99")
    assert eng.llm.get_weight_version() == holds
    assert all(alive(p) for p in eng.engine_pids), "a torn engine must stay alive to be healed"


@vllm
def test_a_complete_sync_is_served_and_named(eng) -> None:
    llm = eng.llm
    llm.start_weight_update()
    llm.update_weights({"update_info": updates(eng, 1)})
    llm.finish_weight_update(weight_version="1")
    assert llm.get_weight_version() == "1"
    st = status(eng)
    assert (st["complete_version"], st["torn"], st["holds"], st["versions_held"]) == (1, False, "1", [1]), st
    out = ask(llm)[0].outputs[0]
    assert out.finish_reason != "error" and len(out.token_ids) == 8
    eng.tokens[1] = list(out.token_ids)


@vllm
def test_an_update_that_applied_nothing_leaves_the_engine_serving(eng) -> None:
    llm = eng.llm
    bad = [dict(updates(eng, 2)[0], plan_digest="0" * 64)]
    llm.start_weight_update()
    with pytest.raises(Exception, match="update packed for plan"):
        llm.update_weights({"update_info": bad})
    assert llm.get_weight_version() == "1"
    assert status(eng)["torn"] is False
    assert list(ask(llm)[0].outputs[0].token_ids) == eng.tokens[1]


@vllm
def test_a_finish_with_groups_missing_tears_the_engine_and_it_refuses_to_serve(eng) -> None:
    llm = eng.llm
    upd = updates(eng, 2)
    names = [g for g, _ in upd[0]["groups"]]  # the weight groups, or their parts (sync_memory_bytes)
    layers = list(dict.fromkeys(map(base_group, names)))
    assert layers == ["pre", "model.layers.0", "model.layers.1", "post"], names
    first = [i for i, g in enumerate(names) if base_group(g) in ("pre", "model.layers.0")]
    assert first == list(range(len(first)))
    llm.start_weight_update()
    llm.update_weights({"update_info": [dict(upd[0], groups=upd[0]["groups"][:len(first)])]})
    with pytest.raises(Exception, match=r"finished without groups .*TORN"):
        llm.finish_weight_update(weight_version="2")
    st = status(eng)
    assert st["torn"] is True and st["complete_version"] == 1 and st["holds"] == "torn:1+2", st
    assert st["groups_not_at_complete_version"] == sorted(names[:len(first)]), st
    assert st["missing_groups"] == sorted(names[len(first):]) and st["partial_groups"] == [], st
    assert_refused(eng, "torn:1+2")


@vllm
def test_an_update_that_raises_half_way_keeps_it_refusing(eng) -> None:
    llm = eng.llm
    groups = updates(eng, 3)[0]["groups"]
    layer1 = [g for g in groups if base_group(g[0]) == "model.layers.1"]
    post = groups[-1]  # the last group: post, or its last part
    assert base_group(post[0]) == "post"
    upd = [dict(updates(eng, 3)[0], groups=[*layer1, [post[0], post[1][:-1]]])]  # post: one byte short
    llm.start_weight_update()  # works: the failed finish's window was closed (vLLM leaves it open)
    with pytest.raises(Exception, match=f"group {re.escape(repr(post[0]))} has .* bytes, expected"):
        llm.update_weights({"update_info": upd})
    st = status(eng)
    assert st["holds"] == "torn:1+2+3" and st["aborted"], st
    written = [g for g, _ in groups if base_group(g) in ("pre", "model.layers.0", "model.layers.1")]
    assert st["groups_not_at_complete_version"] == sorted(written), st
    assert_refused(eng, "torn:1+2+3")


@vllm
def test_a_complete_sync_heals_it_to_what_a_fresh_engine_holds(eng) -> None:
    llm = eng.llm
    llm.start_weight_update()
    llm.update_weights({"update_info": updates(eng, 4)})
    llm.finish_weight_update(weight_version="4")
    assert llm.get_weight_version() == "4"
    st = status(eng)
    assert (st["complete_version"], st["torn"], st["holds"]) == (4, False, "4"), st
    out = ask(llm)[0].outputs[0]
    assert out.finish_reason != "error" and len(out.token_ids) == 8
    tokens = list(out.token_ids)
    assert tokens != eng.tokens[1]
    synced = inspect_engine(llm, str(eng.root / "synced"), 1)
    shutdown(llm)  # one engine at a time on this machine
    eng.llm = None
    deadline = time.monotonic() + 10
    while any(alive(p) for p in eng.engine_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in eng.engine_pids), "the engine's processes outlived its shutdown"
    ref = fresh_reference(eng.ckpt, perturb(eng.base, 4), tp=1, ep=False, out_dir=str(eng.root / "ref"))
    n, mismatched = compare_with(synced, ref.paths)
    assert n > 0 and mismatched == [], mismatched[:10]
    assert tokens == ref.tokens


# ------------------------------------------------------------------------------ failed pull, driver exit
PRODUCER = """
import json, sys
import torch
torch.set_num_threads(1)
from shardsync.engine.producer.producer import Producer, ProducerConfig
from shardsync.verify.checkpoints import load_checkpoint, perturb
from shardsync.source import ModuleSource
prod = Producer(ModuleSource(perturb(load_checkpoint(sys.argv[1]), 1)),
                ProducerConfig(rank=0, n_producers=1, n_consumers=1, token="tok", timeout_s=30.0))
print(json.dumps(prod.address), flush=True)
prod.init()
print("ready", flush=True)
sys.stdin.read()  # until the test is done with it
"""

DRIVER = """
import json, os, signal, sys, tempfile, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine: its shutdown runs in this exit
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from shardsync.verify.reference import engine_kwargs

if __name__ == "__main__":
    ckpt, address, producer_pid = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    from vllm import LLM
    llm = LLM(**engine_kwargs(ckpt, 1, False))
    llm.init_weight_transfer_engine({"init_info": {"plan_dir": tempfile.mkdtemp(), "coordinator": address,
                                                   "token": "tok", "timeout_s": 2.0}})
    print("INITIALISED", flush=True)
    os.kill(producer_pid, signal.SIGSTOP)  # the trainer stops answering (a stalled remote host)
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"version": 1}})
    finally:
        print("UPDATE FAILED", flush=True)
    # the exception ends the script: vLLM shuts the engine (and the shardsync backend) down at exit
"""


@vllm
def test_a_driver_whose_pull_failed_exits_promptly_and_leaves_no_process(ckpt, tmp_path) -> None:
    (tmp_path / "producer.py").write_text(textwrap.dedent(PRODUCER))
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    prod = subprocess.Popen([sys.executable, str(tmp_path / "producer.py"), ckpt], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        address = prod.stdout.readline().strip()
        assert address.startswith("["), address
        drv = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), ckpt, address, str(prod.pid)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        watchdog = threading.Timer(300, lambda: os.killpg(drv.pid, signal.SIGKILL))  # never hang the suite
        watchdog.start()
        lines, failed_at, children = [], None, set()
        try:
            for line in drv.stdout:  # until the driver's output closes (it exited)
                lines.append(line)
                if failed_at is None:
                    children |= set(live_children(drv.pid))
                    if line.startswith("UPDATE FAILED"):
                        failed_at = time.time()
            drv.wait(timeout=30)
            exited_after = time.time() - failed_at if failed_at else None
        finally:
            watchdog.cancel()
            if drv.poll() is None:
                os.killpg(drv.pid, signal.SIGKILL)
                drv.wait()
        log = "".join(lines)
        assert failed_at is not None and "INITIALISED" in log, log[-4000:]
        assert drv.returncode != 0, log[-2000:]
        assert exited_after < 15, f"driver took {exited_after:.1f} s to exit after the failed update\n{log[-3000:]}"
        time.sleep(1)
        left = [p for p in children if alive(p)]
        assert not left, f"processes left behind by the driver: {left}"
    finally:
        os.kill(prod.pid, signal.SIGKILL)
        prod.wait()
