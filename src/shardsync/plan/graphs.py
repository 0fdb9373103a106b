"""Copy programs replayed from CUDA graphs: a chunk's pack (trainer) or unpack (engine) is one launch, not one per
tensor, once its tensors have stayed the same objects for a few calls.

A program is a closure that launches a chunk's copies (``torch._foreach_copy_`` over cached views, and the loaders'
constant fills). While the views are cached (``viewcache._Stable``: the same live tensors at the same addresses) its
``Replay`` launches it directly on the first cached call, captures it into a graph on the next (on the caller's
current stream, in thread-local capture mode so other threads' CUDA calls go on), and from then on replays the
graph: the host work of a chunk is a few microseconds whatever its tensor count. A capture that fails (an op
CUDA graphs cannot hold) turns graphs off for that program and runs it directly. Off on CPU, on the legacy default
stream (not capturable), and when ``shardsync.plan.graphs.ENABLED = False`` (the benchmarks set it from
``SHARDSYNC_CUDA_GRAPHS=0``; the library itself reads no environment variable)::

    rp = Replay()
    rp.run(lambda: torch._foreach_copy_(dsts, srcs), device=buf.device)   # direct, then captured, then replayed
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

__all__ = ["Replay", "ENABLED"]

log = logging.getLogger("shardsync.graphs")

ENABLED = True
"""Capture and replay copy programs on GPUs (False: every program runs directly, as before graphs)."""


class Replay:
    """One program's graph state; reset it whenever the program's views are rebuilt."""

    __slots__ = ("calls", "graph", "failed")

    def __init__(self) -> None:
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False

    def run(self, launch: Callable[[], None], *, device: torch.device) -> None:
        """``launch()`` now, or its graph: captured at the second call on a GPU's side stream, replayed after."""
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return
        if self.calls < 2 or self.failed or device.type != "cuda" or not ENABLED:
            launch()
            return
        stream = torch.cuda.current_stream(device)
        if stream == torch.cuda.default_stream(device):
            self.failed = True  # the legacy default stream cannot be captured
            launch()
            return
        g = torch.cuda.CUDAGraph()
        try:
            g.capture_begin(capture_error_mode="thread_local")
            try:
                launch()
            finally:
                g.capture_end()
        except RuntimeError as e:
            log.warning("shardsync: a copy program could not be captured into a CUDA graph (%s); it runs uncaptured",
                        e)
            self.failed = True
            launch()
            return
        self.graph = g
        g.replay()  # the capture recorded the work without running it
