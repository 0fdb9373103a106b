"""Test set-up: ``tests/`` on the path (``helpers``). Tests are grouped by area, one folder each: ``house``
(layout, wheel, settings reach), ``planning`` (record, checks, pack, schedule, validate, zoo), ``protocol`` (wire,
security, transports), ``engine_core`` (producer/consumer runs, source reads, faults), ``delta_sync``,
``trainer_side`` (FSDP2/Megatron sources, vLLM's trainer API, restarts), ``vllm_engines`` (real vLLM on CPU),
``frameworks`` (verl, Ray), ``programs`` (demo, bench, simulate) and ``gpu`` (the device machine). The tiers are
markers (pyproject.toml): ``vllm``, ``ray``, ``procs`` (further processes without vLLM or Ray) and ``gpu``;
``make test-fast`` deselects them all."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# ``helpers`` and the area folders: a test may reuse another's fixtures (``from test_wire import _Zoo``)
sys.path[:0] = [HERE, *sorted(os.path.join(HERE, d) for d in os.listdir(HERE)
                              if os.path.isdir(os.path.join(HERE, d)) and not d.startswith((".", "_")))]
