"""vLLM's OpenAI server as a first-class path (issue 35, items 6 and 8): the venv's own ``vllm serve`` with the
shardsync backend, a trainer syncing over vLLM's ``HTTPVLLMWeightSyncClient``.

One server (tiny random Qwen3, CPU, ``testing.server.VllmServer``: its own process group, killed at teardown) is
shared by the tests, which run in order and build on each other's state:

1. two syncs over vLLM's HTTP client: the engine equals a fresh load of the trainer's weights, byte for byte
   (every tensor and probe output, ``check_fresh``), serves greedy completions, and its status files are in its
   predictable folder ``{TMPDIR}/shardsync-vllm/pid{pid of vllm serve}``;
2. an engine-side refusal (a tensor of the wrong shape) reaches the trainer with the engine's message (the tensor,
   what was expected), not a bare ``HTTPError: 500``; the engine keeps serving its version;
3. a sync that fails half-way tears the engine: a completion is answered with the TORN reason (HTTP 503), not
   "Internal server error"; the next complete sync heals it, exact again;
4. a clean server stop (Ctrl-C) leaves no status folder and no process behind.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from shardsync.verify.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
from shardsync.verify.reference import save_checkpoint
from shardsync.testing.vllm.vllm_server import VllmServer
from shardsync.source import ModuleSource

pytestmark = pytest.mark.vllm

PROMPT = [1, 17, 42, 99, 7, 3]
STATE: dict = {}
"""What the tests hand on: the last complete version and the weights it carries."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return build_tiny_checkpoint("qwen3", str(tmp_path_factory.mktemp("ckpt") / "qwen3"))


@pytest.fixture(scope="module")
def srv(ckpt, tmp_path_factory):
    server = VllmServer(ckpt, tmpdir=str(tmp_path_factory.mktemp("server-tmp")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def http_client(srv):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    return HTTPVLLMWeightSyncClient(srv.url)  # vLLM's own client, as a user builds it


def trainer(srv, source):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardsync import ShardsyncTrainerInitInfo

    info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0,
                                    init_timeout_s=120, timeout_s=60, lease_s=4)
    return WeightTransferTrainerFactory.trainer_init(info, client=http_client(srv), source=source)


def fresh_check(srv, state: dict, tmp_path, tag: str) -> dict:
    """Every worker compares what it holds with a fresh load of ``state`` (vLLM's loader; read-only)."""
    from shardsync.integrations.vllm.clients import ShardsyncHTTPClient

    ckpt2 = save_checkpoint(state, srv.model, str(tmp_path / f"ckpt-{tag}"))
    out = tmp_path / f"fresh-{tag}"
    ShardsyncHTTPClient(srv.url).init_weight_transfer_engine({"inspect_to": str(out), "check_fresh": ckpt2})
    return json.loads((out / "fresh_rank0.json").read_text())


class FailingSource(ModuleSource):
    """A trainer that fails half-way through a sync: after ``fail_after`` groups (time for the engine to apply
    them), its next group raises."""

    fail_after: int | None = None

    def iter_groups(self):
        for i, batch in enumerate(super().iter_groups()):
            if self.fail_after is not None and i == self.fail_after:
                time.sleep(2.0)
                raise RuntimeError("the trainer failed half-way through the sync (test)")
            yield batch


def test_a_trainer_syncs_over_vllms_http_client_exactly_and_status_is_where_documented(srv, ckpt, tmp_path):
    base = load_checkpoint(ckpt)
    before = srv.completion_tokens(PROMPT)
    state = perturb(base, seed=1)
    engine = trainer(srv, ModuleSource(state))
    try:
        assert engine.engine_workers == 1
        for seed in (1, 2):
            new = perturb(base, seed=seed)
            for k, v in new.items():
                state[k].copy_(v)  # the trainer's tensors change in place, as an optimizer step does
            out = engine.send_weights()
            assert out["bytes_sent"] > 0
        assert srv.weight_version() == "2"
        status = json.loads(open(os.path.join(srv.status_dir, "status_rank0.json")).read())
        assert status["complete_version"] == 2 and status["torn"] is False
        owner = json.loads(open(os.path.join(srv.status_dir, "engine.json")).read())
        assert owner["started_by_pid"] == srv.pid
    finally:
        engine.shutdown()
    got = fresh_check(srv, state, tmp_path, "v2")
    assert got["compared"] > 0 and got["n_mismatched"] == 0 and got["digest"] == got["fresh_digest"], got
    tokens = srv.completion_tokens(PROMPT)
    assert len(tokens) == 8 and tokens != before  # served from the new weights
    STATE.update(version=2, state={k: v.clone() for k, v in state.items()}, tokens=tokens)


def test_an_engine_side_refusal_reaches_the_trainer_with_the_engines_message(srv):
    assert STATE.get("version") == 2, "runs after the first test"
    bad = {k: v.clone() for k, v in STATE["state"].items()}
    name = "model.layers.1.mlp.gate_proj.weight"
    rows, cols = bad[name].shape
    bad[name] = torch.zeros(rows + 8, cols, dtype=bad[name].dtype)
    with pytest.raises(Exception) as err:
        trainer(srv, ModuleSource(bad)).shutdown()
    text = str(err.value)
    assert "500 Server Error" not in text and "POST /init_weight_transfer_engine failed (HTTP 500)" in text, text
    assert f"'{name}': trainer [{rows + 8}, {cols}], engine [{rows}, {cols}]" in text and "rank 0" in text, text
    assert srv.weight_version() == "2" and srv.completion_tokens(PROMPT) == STATE["tokens"]


def test_a_torn_server_answers_requests_with_the_torn_reason_and_a_sync_heals_it(srv, ckpt, tmp_path):
    assert STATE.get("version") == 2, "runs after the first test"
    state = {k: v.clone() for k, v in STATE["state"].items()}
    source = FailingSource(state)
    engine = trainer(srv, source)
    try:
        assert engine.version == 2  # resumes after the engine's version
        source.fail_after = 2
        for k, v in perturb(state, seed=3).items():
            state[k].copy_(v)
        with pytest.raises(Exception) as err:
            engine.send_weights()
        assert "the trainer failed half-way" in str(err.value)
    finally:
        engine.shutdown()
    assert srv.weight_version().startswith("torn:"), srv.weight_version()
    r = srv.completion(PROMPT)
    body = r.json()
    assert r.status_code == 503 and "TORN" in body["error"]["message"], (r.status_code, body)
    assert "Internal server error" not in body["error"]["message"]
    status = json.loads(open(os.path.join(srv.status_dir, "status_rank0.json")).read())
    assert status["torn"] is True and status["holds"] == srv.weight_version(), status
    healed = trainer(srv, ModuleSource(state))
    try:
        healed.send_weights()
        version = healed.version
    finally:
        healed.shutdown()
    assert srv.weight_version() == str(version)
    got = fresh_check(srv, state, tmp_path, "healed")
    assert got["compared"] > 0 and got["n_mismatched"] == 0, got
    assert srv.completion(PROMPT).status_code == 200


def test_a_clean_server_stop_leaves_no_status_folder_and_no_process(srv):
    folder, root, pgid = srv.status_dir, os.path.dirname(srv.status_dir), srv.pid
    engine = trainer(srv, ModuleSource(STATE["state"]))  # a trainer still connected when the server stops
    assert os.path.isdir(folder)
    srv.stop()
    engine.shutdown()  # the server is gone: best effort, nothing hangs
    assert not os.path.exists(folder), os.listdir(folder)
    assert not [d for d in os.listdir(root) if d.startswith("pid")] if os.path.isdir(root) else True
    assert srv.leftover == [], srv.leftover  # vLLM stopped its engine core and workers itself
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # nothing of its process group is left
