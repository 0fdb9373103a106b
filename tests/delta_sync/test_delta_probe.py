"""The delta probe (``python -m shardsync.programs.delta_probe``): a tiny reference trainer at an RL learning rate,
its bf16 weights packed by the real plan code and sent through the delta path; exact, with a changed fraction in
[0, 1] and fewer bytes than dense after the first sync."""

from __future__ import annotations

import contextlib
import io
import json
import math

from shardsync.programs.delta_probe import config_for, main, run_probe
from shardsync.testing.zoo import hf_shapes


def test_the_probe_runs_tiny_and_reports_a_fraction() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--steps", "2", "--tp", "2", "--chunk-mib", "0.05", "--json"]) == 0
    r = json.loads(out.getvalue().strip().splitlines()[-1])  # the JSON is the last stdout line
    assert r["exact"] is True and r["tp"] == 2 and r["chunks"] > 2
    assert 0.0 <= r["changed_fraction"] <= 1.0 and len(r["changed_fraction_per_step"]) == 2
    assert r["first_sync_bytes"] >= r["dense_bytes"] > r["delta_bytes"] > 0  # first sync dense, then deltas


def test_a_step_that_changes_nothing_sends_almost_nothing() -> None:
    r = run_probe(steps=1, lr=0.0)
    assert r["changed_fraction"] == 0.0 and r["exact"]
    assert r["delta_bytes"] < 100 * r["chunks"]  # headers only


def test_config_for_a_parameter_count() -> None:
    for target in (50e6, 300e6, 1e9):
        cfg = config_for(target)
        n = sum(math.prod(s) for s in hf_shapes(cfg).values())
        assert 0.7 * target <= n <= 1.3 * target, (target, n)
