"""``shardsync simulate`` with a changed fraction: the codec's sizes per chunk, fewer bytes and less time than
dense, the CLI flag, the encode/decode rates as inputs, and the Kimi-K2 preset's defaults."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from shardsync.cli import main
from shardsync.delta import codec
from shardsync.programs.sim_delta import DeltaModel, parse_fractions
from shardsync.programs.simulate import PRESETS, run_simulate
from test_sim import TINY_HF

KW = dict(trainer="tp2,pp2,ep2", inference="tp2,ep2", replicas=2, trainer_nodes=1, gpus_per_node=8)


def _run(tmp_path, **kw) -> dict:
    path = tmp_path / "tiny-dsv3.json"
    path.write_text(json.dumps(TINY_HF))
    with contextlib.redirect_stdout(io.StringIO()):
        return run_simulate(config=str(path), record="template", **KW, **kw)


def test_delta_model_sizes_follow_the_codec() -> None:
    nb = 64 << 20
    words = nb // 2
    for f, kind in ((0.0, codec.PAIRS), (0.01, codec.PAIRS), (0.05, codec.BITMAP), (0.99, codec.DENSE)):
        k = round(f * words)
        want = codec.payload_nbytes(kind, nb, words if kind == codec.DENSE else k) + codec.HEADER_MAX
        assert DeltaModel(fraction=f).wire_bytes(nb) == want
    assert DeltaModel(fraction=1.0).wire_bytes(1001) == 1001 + codec.HEADER_MAX  # never above dense + header
    for bad in (dict(fraction=-0.1), dict(fraction=1.5), dict(fraction=0.1, encode_gbps=0)):
        with pytest.raises(ValueError):
            DeltaModel(**bad)
    assert parse_fractions("0.01, 2%,0.05") == [0.01, 0.02, 0.05] and parse_fractions("") == []
    with pytest.raises(ValueError):
        parse_fractions("1,x")


def test_fractions_cut_bytes_and_time_and_rates_matter(tmp_path) -> None:
    r = _run(tmp_path, changed_fractions=[0.0, 0.01, 0.05, 1.0])
    d0, d1, d5, d100 = r["delta"]
    assert d0["consumer_bytes_sum"] < d1["consumer_bytes_sum"] < d5["consumer_bytes_sum"] < r["consumer_bytes_sum"]
    assert d100["consumer_bytes_sum"] >= r["consumer_bytes_sum"]  # all changed: dense plus headers
    assert d1["bytes_ratio"] > d5["bytes_ratio"] > 1 and d100["bytes_ratio"] <= 1
    assert d1["parallel_pp_s"] <= r["parallel_pp_s"] and d1["predicted_s"] <= r["predicted_s"]
    assert d1["held_bytes_per_consumer_max"] == r["per_consumer_bytes_max"] and d1["history_bytes_per_producer_max"] > 0
    slow = _run(tmp_path, changed_fractions=[0.01], encode_gbps=0.01, decode_gbps=0.01)["delta"][0]
    assert slow["predicted_s"] > d1["predicted_s"] and slow["parallel_pp_s"] > d1["parallel_pp_s"]
    assert "delta" not in _run(tmp_path)  # no fractions: the dense report as before


def test_cli_flag_and_kimi_preset_defaults(tmp_path) -> None:
    assert PRESETS["kimi-k2-48n"]["delta"] == (0.01, 0.02, 0.05) and PRESETS["kimi-k2-48n"]["seed"]["measured_s"] == 7.53
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY_HF))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["simulate", "--config", str(path), "--trainer", "tp2,pp2,ep2", "--inference", "tp2,ep2",
                   "--replicas", "2", "--trainer-nodes", "1", "--record", "template", "--changed-fraction", "1%,5%",
                   "--encode-gbps", "100", "--json"])
    assert rc == 0
    r = json.loads(out.getvalue().strip().splitlines()[-1])
    assert [x["changed_fraction"] for x in r["delta"]] == [0.01, 0.05] and r["delta"][0]["encode_gbps"] == 100
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["simulate", "--config", str(path), "--trainer", "tp2", "--inference", "tp2",
                     "--trainer-nodes", "1", "--changed-fraction", "7"]) == 2
