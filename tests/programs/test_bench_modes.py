"""``shardsync bench --mode all --json`` end to end (subprocess): a Megatron TP2·PP2·EP2 trainer (8 producer
processes) -> one TP2 zoo replica in each of the four modes (v1 gather everything everywhere, v2 PP/EP-local
gathers, v3 + pipelined, v4 + PP stages in parallel); every mode's syncs byte-exact, and gathering everything
everywhere holds more full tensors at once than PP/EP-local gathers. No timing assertions (timings are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.procs


def test_bench_modes_all_json_exact_and_v1_gathers_more() -> None:
    p = subprocess.run([sys.executable, "-m", "shardsync.cli", "bench", "--mode", "all", "--syncs", "1", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, p.stdout[-2000:]  # under --json, stdout is the JSON line alone
    modes = json.loads(lines[-1])["modes"]
    assert sorted(modes) == ["v1", "v2", "v3", "v4"]
    for name, m in modes.items():
        assert m["exact"] is True, (name, m)
        assert m["s"] > 0 and m["peak_gathered_bytes"] > 0, (name, m)
    assert modes["v1"]["peak_gathered_bytes"] > modes["v2"]["peak_gathered_bytes"], modes
    assert modes["v3"]["max_resident"] == 2 and modes["v2"]["max_resident"] == 1, modes  # lookahead 1 vs 0
    assert not modes["v3"]["parallel_producers"] and modes["v4"]["parallel_producers"], modes
