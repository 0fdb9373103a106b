"""Output for ``--json`` runs: the JSON goes to the real stdout, everything else to stderr.

    with json_mode(as_json):       # human lines (print) -> stderr while it is open
        ...
        emit_json({"exact": True})  # always the process's stdout
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, Iterator


_REAL_STDOUT: list[Any] = []
"""The process's real stdout while :func:`json_mode` is open (a stack: nested modes keep the outermost one's)."""


def emit_json(obj: Any) -> None:
    out = _REAL_STDOUT[-1] if _REAL_STDOUT else sys.stdout
    out.write(json.dumps(obj) + "\n")
    out.flush()


@contextlib.contextmanager
def json_mode(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    _REAL_STDOUT.append(_REAL_STDOUT[-1] if _REAL_STDOUT else sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _REAL_STDOUT.pop()
