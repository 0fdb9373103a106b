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


def emit_json(obj: Any) -> None:
    out = sys.__stdout__ or sys.stdout
    out.write(json.dumps(obj) + "\n")
    out.flush()


@contextlib.contextmanager
def json_mode(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield
