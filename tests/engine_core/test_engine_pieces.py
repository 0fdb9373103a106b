"""Small pure pieces of the runtime: 'the next group after g', the hot-path scope, the CPU publisher."""

from __future__ import annotations

import gc
import sys
import threading

import pytest

from shardsync.engine.lanes import Lane, hot_path
from shardsync.engine.producer.publish import Publisher
from shardsync.engine.producer.versions import VersionState, next_group_for
from shardsync.errors import SyncError


def _state() -> VersionState:
    st = VersionState(members={"c0": ("d", "s"), "c1": ("e", "s")})
    for g in ("pre", "model.layers.0", "model.layers.1", "post"):
        st.packed.append(g)
        st.ready[g] = {"d": [[0, 0, 8, -1]]} if g != "model.layers.0" else {"e": [[0, 0, 8, -1]]}
        st.pending[g] = {"c0", "c1"}
    return st


def test_next_group_after_is_idempotent_and_skips_other_plans_and_released_groups() -> None:
    st = _state()
    nxt = next_group_for
    assert nxt(st, "c0", "d") == "pre"
    assert nxt(st, "c0", "d", "pre") == "model.layers.1"  # layers.0 is not packed for plan d
    assert nxt(st, "c0", "d", "pre") == "model.layers.1"  # asked again: same answer
    st.pending["pre"].discard("c0")  # released meanwhile: "after" still anchors on the same group
    assert nxt(st, "c0", "d", "pre") == "model.layers.1"
    assert nxt(st, "c0", "d") == "model.layers.1"
    assert nxt(st, "c0", "d", "post") == ""  # nothing packed after the last group yet
    with pytest.raises(SyncError, match="not packed"):
        nxt(st, "c0", "d", "model.layers.7")


def test_hot_path_scopes_nest_and_restore_the_interpreter() -> None:
    before, enabled = sys.getswitchinterval(), gc.isenabled()
    with hot_path(0.0003):
        assert sys.getswitchinterval() == pytest.approx(0.0003) and not gc.isenabled()
        with hot_path(0.0003):  # a concurrent sync: one shared scope
            pass
        assert sys.getswitchinterval() == pytest.approx(0.0003) and not gc.isenabled()
    assert sys.getswitchinterval() == before and gc.isenabled() == enabled
    with hot_path(None):
        assert sys.getswitchinterval() == before and gc.isenabled() == enabled
    with pytest.raises(RuntimeError):
        with hot_path(0.0003):
            raise RuntimeError("a failing sync")
    assert sys.getswitchinterval() == before and gc.isenabled() == enabled


def test_cpu_publisher_announces_at_once_in_the_caller() -> None:
    pub = Publisher(Lane(None), timeout_s=1, who="producer 0")
    seen: list = []
    pub.submit(lambda: seen.append(threading.current_thread()), what="packing group 'pre'", hold=[object()])
    pub.flush()
    pub.close()
    assert seen == [threading.current_thread()]
