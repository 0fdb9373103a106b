"""``shardsync demo`` (issue 15): the toy task and its objective, the process host, the in-worker fresh-load check,
and short runs of the RL loop — every step exact against a fresh load, a killed engine rejoining exact."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from shardsync.testing.harness.hosts import Hosted, HostedDied, HostedError
from shardsync.programs.rl.task import Task, advantages, grpo_loss, make_batch, make_prompts, rewards, score, split_batch


# ---------------------------------------------------------------- the task (pure)
def test_score_counts_answers_above_the_prompts_last_number():
    assert score([5, 9, 3], [4, 3, 2, 10]) == 0.5
    assert score([1, 2], []) == 0.0


def test_prompts_leave_room_for_a_correct_answer():
    task = Task()
    ps = make_prompts(random.Random(0), 200, task)
    assert all(len(p) == task.prompt_len and p[-1] < task.vocab - 1 for p in ps)


def test_group_relative_advantages():
    a = advantages([1.0, 0.0, 0.5, 0.5])
    assert abs(sum(a)) < 1e-9 and a[0] > 0 > a[1] and a[2] == a[3] == pytest.approx(0.0)
    assert advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]  # nothing to learn from a group that scored the same


def test_batch_rows_and_split():
    task = Task(vocab=16, prompt_len=2, answer_len=3)
    prompts = [[1, 2], [3, 4]]
    answers = [[[5, 6, 7], [0, 0, 0]], [[9, 9, 9], [1, 1, 1]]]
    b = make_batch(prompts, answers, rewards(prompts, answers), task)
    assert b["ids"].tolist() == [[1, 2, 5, 6, 7], [1, 2, 0, 0, 0], [3, 4, 9, 9, 9], [3, 4, 1, 1, 1]]
    assert b["adv"][0] > 0 > b["adv"][1]
    assert split_batch(b, 1, 2)["ids"].tolist() == [[3, 4, 9, 9, 9], [3, 4, 1, 1, 1]]
    with pytest.raises(ValueError, match="split evenly"):
        split_batch(b, 0, 3)
    with pytest.raises(ValueError, match="expected 2 \\+ 3"):
        make_batch(prompts, [[[5, 6], [0, 0, 0]], answers[1]], [[1.0, 0.0], [1.0, 0.0]], task)


def test_a_grpo_step_makes_the_rewarded_answer_more_likely():
    torch.manual_seed(0)
    task = Task(vocab=16, prompt_len=2, answer_len=3)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 16)
            self.out = torch.nn.Linear(16, 16)

        def forward(self, input_ids):
            return type("O", (), {"logits": self.out(self.emb(input_ids))})()

    model = Tiny()
    prompts = [[1, 2]]
    answers = [[[9, 9, 9], [0, 0, 0]]]
    b = make_batch(prompts, answers, rewards(prompts, answers), task)

    def logp(row):
        with torch.no_grad():
            lp = torch.log_softmax(model(b["ids"][row:row + 1]).logits[0, 1:-1], -1)
            return lp.gather(-1, b["ids"][row, 2:, None]).sum().item()

    before = (logp(0), logp(1))
    grpo_loss(model, b).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    assert logp(0) > before[0] and logp(1) < before[1]


# ---------------------------------------------------------------- the process host
@pytest.mark.procs
def test_hosted_calls_errors_timeouts_and_death():
    h = Hosted("counter", "collections:Counter", {})
    try:
        h.ready(60)
        assert h.started()
        h.call("update", "abca").result(30)
        assert h.call("most_common", 1).result(30) == [("a", 2)]
        with pytest.raises(HostedError, match="no_such_method"):
            h.call("no_such_method").result(30)
        h.kill()
        t0 = time.monotonic()
        with pytest.raises(HostedDied, match="counter died before answering most_common"):
            h.call("most_common").result(60)
        assert time.monotonic() - t0 < 10  # a dead child fails the call at once, not at the deadline
    finally:
        h.kill()
    e = Hosted("event", "threading:Event", {})
    try:
        e.ready(60)
        with pytest.raises(TimeoutError, match="event: no answer to wait\\(\\) within 1 s"):
            e.call("wait", 30).result(1)
    finally:
        e.kill()
    bad = Hosted("bad", "fractions:Fraction", {"numerator": "not a number"})
    try:
        with pytest.raises(HostedError, match="constructing fractions:Fraction: ValueError"):
            bad.ready(60)
    finally:
        bad.kill()


# ---------------------------------------------------------------- the fresh-load check can fail
@pytest.mark.vllm
def test_fresh_check_passes_on_the_same_weights_and_fails_on_others(tmp_path):
    from vllm import LLM

    from shardsync.verify.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
    from shardsync.verify.reference import cpu_env, engine_kwargs, save_checkpoint, shutdown

    cpu_env(1)
    ckpt = build_tiny_checkpoint("qwen3", str(tmp_path / "q3"))
    other = save_checkpoint(perturb(load_checkpoint(ckpt), 3), ckpt, str(tmp_path / "other"))
    llm = LLM(**engine_kwargs(ckpt, 1, False))
    try:
        def check(path: str, tag: str) -> dict:
            out = tmp_path / tag
            llm.init_weight_transfer_engine({"init_info": {"inspect_to": str(out), "check_fresh": path}})
            return json.loads((out / "fresh_rank0.json").read_text())

        same = check(ckpt, "same")
        assert same["compared"] > 20 and same["n_mismatched"] == 0 and same["digest"] == same["fresh_digest"]
        diff = check(other, "other")
        assert diff["n_mismatched"] > 0 and diff["digest"] != diff["fresh_digest"]
        assert any("qkv_proj" in k for k in diff["mismatched"]), diff["mismatched"]
        missing = check(str(tmp_path / "nowhere"), "missing")  # reported, and the engine lives on
        assert missing["compared"] == 0 and "fresh load of" in missing["error"]
        assert check(ckpt, "again")["n_mismatched"] == 0
    finally:
        shutdown(llm)


# ---------------------------------------------------------------- the loop
def _demo(tmp_path, *extra: str) -> tuple[dict, dict]:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "shardsync.cli", "demo", "--steps", "3", "--kill-engine-at", "2",
                           "--out", str(out), "--json", *extra], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]  # --json: stdout carries only the JSON
    summary = json.loads(lines[0])
    report = json.loads((out / "report.json").read_text())
    assert (out / "demo.png").stat().st_size > 10_000
    print(f"rewards per step: {[round(s['reward'], 3) for s in report['per_step']]}", file=sys.stderr)
    return summary, report


def _check_loop(summary: dict, report: dict) -> None:
    assert set(summary) >= {"steps", "reward_first", "reward_last", "syncs", "all_exact", "rejoined"}
    assert summary["steps"] == 3 and summary["all_exact"] is True
    assert [s["engines"] for s in summary["syncs"]] == [["r0", "r1"], ["r0"], ["r0", "r1"]]
    assert all(s["exact"] for s in summary["syncs"])
    assert summary["killed"] == [{"step": 2, "engine": "r1"}]
    assert summary["rejoined"] == [{"step": 3, "engine": "r1"}]
    for s in report["per_step"]:  # each engine that synced compared every tensor with a fresh load of the version
        assert s["exact"] and all(s["exact"].values()), s
        assert all(b == report["per_step"][0]["model_bytes"] for b in s["bytes_per_engine"].values()), s
    assert len({s["weights_sha256"] for s in report["per_step"]}) == 3  # the weights changed every step
    assert report["per_step"][2]["members"] == ["r0/rank0", "r1/rank0"]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_demo_loop_is_exact_every_step_and_a_killed_engine_rejoins(tmp_path):
    """With ``--delta`` (issue 27): the rejoined engine holds no base and reads its first sync dense."""
    summary, report = _demo(tmp_path, "--delta")
    _check_loop(summary, report)
    wire = [s["wire_bytes_per_engine"] for s in report["per_step"]]
    model = report["per_step"][0]["model_bytes"]
    assert all(b >= model for b in wire[0].values()), wire  # the first sync: dense everywhere
    assert wire[2]["r1"] >= model, wire  # restarted at step 2, rejoined at step 3: dense again (and exact)
    assert all(0 < wire[i]["r0"] <= wire[0]["r0"] for i in (1, 2)), wire  # r0 held every base
    assert report["per_step"][1]["dropped"] == ["r1/rank0"]  # a member of version 2, dropped when its lease ran out
    # fixed seeds (the policy's init, the prompts, vLLM's per-request sampling seeds) make the rewards the same in
    # every run here (0.701, 0.547, 0.760, ... seen in every run, with and without Ray): step 3 beats step 1
    assert summary["reward_last"] > summary["reward_first"]


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_demo_loop_on_ray(tmp_path):
    summary, report = _demo(tmp_path, "--ray")
    _check_loop(summary, report)
    # the actor watch evicted it at once: either before version 2 began (not a member) or during it (dropped)
    step2 = report["per_step"][1]
    assert step2["members"] == ["r0/rank0"] or step2["dropped"] == ["r1/rank0"], step2
    assert step2["sync_s"] < report["config"]["lease_s"]
