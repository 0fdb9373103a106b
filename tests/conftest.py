"""Test set-up: ``tests/`` on the path (``helpers``). The tiers are markers (pyproject.toml): ``vllm``, ``ray``,
``procs`` (further processes without vLLM or Ray) and ``gpu``; ``make test-fast`` deselects them all."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
