"""A restarted trainer takes over a running engine; a second live trainer is refused (real vLLM, real processes).

One CPU vLLM engine (tiny Qwen3, in-process ``LLM`` here, in this test process) is served to trainer PROCESSES over
HTTP with the routes of vLLM's RL API (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/shutdown_weight_transfer_engine``, ``/get_world_size``, ``/weight_info``; a small shim
over the ``LLM``, one request at a time as an engine core takes them). Each trainer process runs vLLM's trainer API
(``trainer_init`` + ``send_weights``) with shardsync's backend, the weights of version ``v`` being
``perturb(base, v)``. The tests share the engine and run in order:

1. a trainer syncs 1, 2 and exits cleanly; a new trainer process resumes at 3 (from the engine's version);
2. a second trainer (another port) is refused at once with ``EngineOwnedError`` naming the owner's coordinator;
   the owner keeps syncing (4);
3. an update replayed with the first (ended) session's id is refused; nothing changes, the engine serves;
4. the owner is SIGKILLed mid-sync of 5 (groups applied): the engine is TORN and refuses requests; a new trainer
   process naming ``start_version=100`` (a checkpoint's step) takes the engine over once the old lease lapsed,
   syncs 101, which heals it; the engine then equals a FRESH engine started on version 101's weights, byte for
   byte (every tensor, probe outputs, greedy tokens).

Then the same over ``vllm serve`` and vLLM's own HTTP client (a second trainer refused; a killed owner's successor
resumes after ``torn:1+2`` and heals the server), and the pure pieces (labels -> resume version, re-typing).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from shardsync.verify.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
from shardsync.verify.reference import (PROMPT, compare_with, cpu_env, engine_kwargs,
                                                           fresh_reference, generate, inspect_engine, shutdown)

vllm = pytest.mark.vllm
LEASE_S = 2.0

TRAINER = r'''
import json, sys, time
import torch
torch.set_num_threads(1)
import requests
from shardsync.integrations.vllm import compat
from shardsync.integrations.vllm.ownership import EngineOwnedError
from shardsync.verify.checkpoints import load_checkpoint, perturb
from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo
from shardsync.source import ModuleSource


class Client:
    """vLLM's HTTP weight-sync client's calls; a failure carries the engine's message."""

    def __init__(self, base_url):
        self.base_url = base_url

    def _post(self, path, body=None):
        r = requests.post(f"{self.base_url}/{path}", json=body, timeout=300)
        if not r.ok:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.json().get('error', r.text)}")

    def init_weight_transfer_engine(self, init_info):
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self._post("start_weight_update")

    def update_weights(self, update_info):
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self._post("finish_weight_update", {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self):
        self._post("shutdown_weight_transfer_engine")


class Stalling(ModuleSource):
    """Stops for good before its third group once told to (the test then kills this process mid-sync)."""
    stall = False

    def iter_groups(self):
        for i, batch in enumerate(super().iter_groups()):
            if self.stall and i == 2:
                print(json.dumps({"midsync": True}), flush=True)
                time.sleep(3600)
            yield batch


def say(**kw):
    print(json.dumps(kw), flush=True)


if __name__ == "__main__":
    url, ckpt, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    base = load_checkpoint(ckpt)
    state = {k: t.clone() for k, t in base.items()}
    source = Stalling(state)
    info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0,
                                    lease_s=opts["lease_s"], timeout_s=30.0, init_timeout_s=60.0,
                                    start_version=opts.get("start_version"))
    if opts.get("client") == "vllm-http":  # vLLM's own HTTP client, against vLLM's OpenAI server
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        client = HTTPVLLMWeightSyncClient(url)
    else:
        client = Client(url)
    t0 = time.monotonic()
    try:
        eng = compat.factory_trainer_init(info, client=client, source=source)
    except Exception as e:
        say(error=str(e), type=type(e).__name__, owned=isinstance(e, EngineOwnedError), seconds=time.monotonic() - t0)
        sys.exit(3)
    say(ready=True, version=eng.version, session=eng.session, address=list(eng.producer.address),
        seconds=time.monotonic() - t0)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd in ("sync", "stall"):
            source.stall = cmd == "stall"
            new = perturb(base, eng.version + 1)
            for k, t in state.items():
                t.copy_(new[k])
            try:
                out = eng.send_weights()
                say(version=out["version"], completed=out["completed"])
            except Exception as e:
                say(error=str(e), type=type(e).__name__)
        elif cmd == "exit":
            eng.shutdown()
            say(exited=True)
            break
'''


class Shim(BaseHTTPRequestHandler):
    """vLLM's RL API routes over the in-process ``LLM`` (``server.llm``), one call at a time."""

    def log_message(self, *args) -> None:
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the trainer that asked is gone (killed mid-call)
            pass

    def _run(self, fn) -> None:
        try:
            with self.server.lock:
                out = fn(self.server.llm)
            self._reply(200, out or {})
        except Exception as e:
            self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    def do_GET(self) -> None:
        if self.path.startswith("/get_world_size"):
            self._run(lambda llm: {"world_size": 1})
        elif self.path.startswith("/weight_info"):
            self._run(lambda llm: {"weight_version": llm.get_weight_version()})
        else:
            self._reply(404, {"error": self.path})

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"null") or {}
        route = self.path.strip("/")
        calls = {
            "init_weight_transfer_engine": lambda llm: llm.init_weight_transfer_engine({"init_info": body["init_info"]}),
            "start_weight_update": lambda llm: llm.start_weight_update(),
            "update_weights": lambda llm: llm.update_weights({"update_info": body["update_info"]}),
            "finish_weight_update": lambda llm: llm.finish_weight_update(weight_version=body.get("weight_version")),
            "shutdown_weight_transfer_engine": lambda llm: llm.shutdown_weight_transfer_engine(),
        }
        if route not in calls:
            self._reply(404, {"error": route})
            return
        self._run(calls[route])


class Trainer:
    """One trainer process; ``ask`` sends a command and returns its JSON answer."""

    def __init__(self, url: str, ckpt: str, tmp, **opts) -> None:
        script = tmp / "trainer.py"
        script.write_text(textwrap.dedent(TRAINER))
        self.proc = subprocess.Popen([sys.executable, str(script), url, ckpt,
                                      json.dumps({"lease_s": LEASE_S, **opts})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.hello = self.read(timeout_s=240)

    def read(self, timeout_s: float = 180) -> dict:
        box: dict = {}

        def get() -> None:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    box["out"] = json.loads(line)
                    return

        th = threading.Thread(target=get, daemon=True)
        th.start()
        th.join(timeout_s)
        assert "out" in box, f"trainer {self.proc.pid} said nothing within {timeout_s} s (rc {self.proc.poll()})"
        return box["out"]

    def ask(self, cmd: str, timeout_s: float = 180) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read(timeout_s)

    def exit(self) -> None:
        assert self.ask("exit") == {"exited": True}
        assert self.proc.wait(timeout=60) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    ckpt = build_tiny_checkpoint("qwen3", str(root / "qwen3"))
    cpu_env(1)
    from vllm import LLM

    llm = LLM(**engine_kwargs(ckpt, 1, False))
    server = ThreadingHTTPServer(("127.0.0.1", 0), Shim)
    server.llm, server.lock = llm, threading.Lock()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ns = SimpleNamespace(llm=llm, server=server, ckpt=ckpt, base=load_checkpoint(ckpt), root=root,
                         url=f"http://127.0.0.1:{server.server_address[1]}", trainers=[], sessions={})
    yield ns
    for t in ns.trainers:
        t.kill()
    server.shutdown()
    if ns.llm is not None:
        shutdown(ns.llm)


def call(eng, fn):
    with eng.server.lock:
        return fn(eng.llm)


def start(eng, tmp, **opts) -> Trainer:
    t = Trainer(eng.url, eng.ckpt, tmp, **opts)
    eng.trainers.append(t)
    return t


def ask_engine(eng):
    from vllm import SamplingParams

    return call(eng, lambda llm: llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8),
                                              use_tqdm=False)[0].outputs[0])


@vllm
def test_a_trainer_that_exited_is_followed_by_a_new_process_that_resumes_at_the_engines_version(eng, tmp_path):
    first = start(eng, tmp_path)
    assert first.hello.get("ready") and first.hello["version"] == 0, first.hello
    out = first.ask("sync")
    assert out["version"] == 1 and out["completed"], out
    out = first.ask("sync")
    assert out["version"] == 2 and out["completed"], out
    first.exit()
    eng.sessions["first"] = first.hello["session"]
    assert call(eng, lambda llm: llm.get_weight_version()) == "2"
    second = start(eng, tmp_path)
    assert second.hello.get("ready") and second.hello["version"] == 2, second.hello  # resumes after 2
    out = second.ask("sync")
    assert out["version"] == 3 and out["completed"], out
    assert call(eng, lambda llm: llm.get_weight_version()) == "3"
    eng.owner = second


@vllm
def test_a_second_trainer_is_refused_at_once_naming_the_owner_and_the_owner_keeps_syncing(eng, tmp_path):
    owner = eng.owner
    other = start(eng, tmp_path)
    assert other.proc.wait(timeout=60) == 3, other.hello
    host, port = owner.hello["address"]
    assert other.hello["owned"] and other.hello["type"] == "EngineOwnedError", other.hello
    assert f"{owner.hello['session']!r} at coordinator {host}:{port}" in other.hello["error"], other.hello
    assert other.hello["seconds"] < 15, other.hello  # at once: not after a lease or init_timeout_s
    out = owner.ask("sync")
    assert out["version"] == 4 and out["completed"], out
    assert call(eng, lambda llm: llm.get_weight_version()) == "4"


@vllm
def test_an_update_replayed_from_an_old_session_is_refused_and_changes_nothing(eng):
    call(eng, lambda llm: llm.start_weight_update())
    with pytest.raises(Exception, match="is not the session that owns this engine"):
        call(eng, lambda llm: llm.update_weights({"update_info": {"version": 9, "session": eng.sessions["first"]}}))
    assert call(eng, lambda llm: llm.get_weight_version()) == "4"
    out = ask_engine(eng)
    assert out.finish_reason != "error" and len(out.token_ids) == 8


@vllm
def test_a_trainer_killed_mid_sync_is_replaced_and_the_new_session_heals_the_engine_exactly(eng, tmp_path):
    owner = eng.owner
    assert owner.ask("stall") == {"midsync": True}
    time.sleep(2.0)  # the engine pulls and applies the groups served so far
    owner.kill()
    deadline = time.monotonic() + 60
    while not str(call(eng, lambda llm: llm.get_weight_version())).startswith("torn:"):
        assert time.monotonic() < deadline, "the engine did not report torn weights after its trainer died"
        time.sleep(0.5)
    label = call(eng, lambda llm: llm.get_weight_version())
    assert label == "torn:4+5", label
    out = ask_engine(eng)
    assert out.finish_reason == "error" and list(out.token_ids) == [] and "TORN" in out.stop_reason, out
    new = start(eng, tmp_path, start_version=100)  # restarted from a checkpoint of step 100
    assert new.hello.get("ready") and new.hello["version"] == 100, new.hello
    out = new.ask("sync")
    assert out["version"] == 101 and out["completed"], out
    assert call(eng, lambda llm: llm.get_weight_version()) == "101"
    new.exit()
    tokens = call(eng, generate)
    synced = call(eng, lambda llm: inspect_engine(llm, str(eng.root / "synced"), 1))
    with eng.server.lock:
        shutdown(eng.llm)  # one engine at a time on this machine
        eng.llm = None
    ref = fresh_reference(eng.ckpt, perturb(eng.base, 101), tp=1, ep=False, out_dir=str(eng.root / "ref"))
    n, mismatched = compare_with(synced, ref.paths)
    assert n > 0 and mismatched == [], mismatched[:10]
    assert tokens == ref.tokens and len(tokens) == 8


# ------------------------------------------------------------------------------ pure
@pytest.mark.parametrize("case", ["versions", "not_versions"])
def test_resume_version_reads_the_engines_labels(case) -> None:
    from shardsync.integrations.vllm.ownership import resume_version

    table = {"versions": [(["3"], 3), (["torn:4+5"], 5), (["2", "torn:1+7"], 7), ([], 0)],
             "not_versions": [(["step-500"], 0), (["torn:?"], 0), ([""], 0)]}
    for labels, want in table[case]:
        assert resume_version(labels) == want, labels


def test_an_ownership_refusal_that_crossed_http_as_text_is_typed_again() -> None:
    from shardsync.integrations.vllm.ownership import (OWNED_MARK, STALE_MARK, EngineOwnedError, StaleSessionError,
                                                       retype)

    assert isinstance(retype(RuntimeError(f"HTTP 500: rank 0: this engine {OWNED_MARK} 'ab' at ...")),
                      EngineOwnedError)
    assert isinstance(retype(RuntimeError(f"rank 0: update version 3 of trainer session 'x' {STALE_MARK}")),
                      StaleSessionError)
    other = RuntimeError("something else")
    assert retype(other) is other


# ------------------------------------------------------------------------------ vLLM's OpenAI server
@vllm
def test_over_vllms_openai_server_a_second_trainer_is_refused_and_a_killed_ones_successor_heals_it(tmp_path):
    """The same over ``vllm serve`` and vLLM's ``HTTPVLLMWeightSyncClient``: the owner syncs 1; a second trainer is
    refused at once naming it; the owner, SIGKILLed mid-sync of 2, leaves the server torn (503 naming TORN); a new
    trainer process resumes after it (``torn:1+2`` -> 3), takes over once the lease lapsed and heals it, equal to a
    fresh load of version 3's weights in the worker (every tensor and probe output)."""
    from shardsync.integrations.vllm.clients import ShardsyncHTTPClient
    from shardsync.verify.reference import save_checkpoint
    from shardsync.testing.vllm.vllm_server import VllmServer

    ckpt = build_tiny_checkpoint("qwen3", str(tmp_path / "qwen3"))
    base = load_checkpoint(ckpt)
    prompt = PROMPT[0]["prompt_token_ids"]
    short = tempfile.mkdtemp(prefix="ss-restart-")  # vLLM's zmq ipc paths live here: at most 107 characters
    srv = VllmServer(ckpt, tmpdir=short)
    srv.start()
    trainers: list[Trainer] = []

    def new(**opts) -> Trainer:
        trainers.append(Trainer(srv.url, ckpt, tmp_path, client="vllm-http", **opts))
        return trainers[-1]

    try:
        owner = new()
        assert owner.hello.get("ready") and owner.hello["version"] == 0, owner.hello
        out = owner.ask("sync")
        assert out["version"] == 1 and out["completed"], out
        other = new()
        assert other.proc.wait(timeout=60) == 3 and other.hello["type"] == "EngineOwnedError", other.hello
        host, port = owner.hello["address"]
        assert f"at coordinator {host}:{port}" in other.hello["error"] and other.hello["seconds"] < 15, other.hello
        assert owner.ask("stall") == {"midsync": True}
        time.sleep(2.0)
        owner.kill()
        deadline = time.monotonic() + 60
        while not srv.weight_version().startswith("torn:"):
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.5)
        assert srv.weight_version() == "torn:1+2"
        r = srv.completion(prompt)
        assert r.status_code == 503 and "TORN" in r.json()["error"]["message"], (r.status_code, r.text[:500])
        successor = new()
        assert successor.hello.get("ready") and successor.hello["version"] == 2, successor.hello
        out = successor.ask("sync")
        assert out["version"] == 3 and out["completed"], out
        assert srv.weight_version() == "3" and srv.completion(prompt).status_code == 200
        successor.exit()
        fresh = save_checkpoint(perturb(base, 3), ckpt, str(tmp_path / "ckpt-v3"))
        ShardsyncHTTPClient(srv.url).init_weight_transfer_engine({"inspect_to": str(tmp_path / "fresh"),
                                                                  "check_fresh": fresh})
        got = json.loads((tmp_path / "fresh" / "fresh_rank0.json").read_text())
        assert got["compared"] > 0 and got["n_mismatched"] == 0 and got["digest"] == got["fresh_digest"], got
    finally:
        for t in trainers:
            t.kill()
        srv.stop()
        shutil.rmtree(short, ignore_errors=True)
