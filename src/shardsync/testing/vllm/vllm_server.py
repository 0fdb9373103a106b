"""A real vLLM OpenAI server (``vllm serve``) with the shardsync backend, started and stopped for tests and checks.

    with VllmServer(ckpt, tmpdir=str(tmp_path)) as srv:       # vllm serve, in its own process group
        client = HTTPVLLMWeightSyncClient(srv.url)             # vLLM's HTTP client (its RL routes are on)
        srv.status_dir                                         # {tmpdir}/shardsync-vllm/pid{srv.pid}
        srv.completion_tokens([1, 17, 42], max_tokens=8)       # greedy tokens of /v1/completions
    # stopped like Ctrl-C (SIGINT to vllm serve), then anything of its process group still there is killed

The server runs the venv's own ``vllm`` command (``VLLM_SERVER_DEV_MODE=1``: vLLM's RL routes) on CPU settings
(``VLLM_CPU_KVCACHE_SPACE=1``, ``--enforce-eager``, ``--max-model-len 128``, ``--skip-tokenizer-init``: the tiny
test checkpoints have no tokenizer; prompts go as token ids). ``tmpdir`` becomes the server's ``TMPDIR``, so its
default status folder is known in advance and nothing lands in the machine's /tmp.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["VllmServer", "free_port", "vllm_command"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    """The ``vllm`` command of this interpreter's environment; refuses one that would die on its own version lookup
    (vllm-cpu without the ``vllm`` alias: ``python -m shardsync.integrations.vllm.dist_alias`` writes it)."""
    from ...integrations.vllm.dist_alias import alias_needed

    if alias_needed() is not None:
        raise RuntimeError("`vllm serve` cannot start in this environment: vllm-cpu is installed without a `vllm` "
                           "distribution and vLLM's CLI looks its version up under that name; run "
                           f"`{sys.executable} -m shardsync.integrations.vllm.dist_alias` once (make venv does)")
    exe = os.path.join(os.path.dirname(sys.executable), "vllm")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


class VllmServer:
    """``vllm serve MODEL`` with ``--weight-transfer-config '{"backend": "shardsync"}'`` as a subprocess."""

    def __init__(self, model: str, *, host: str = "127.0.0.1", port: int | None = None, tmpdir: str | None = None,
                 log_path: str | None = None, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 start_timeout_s: float = 600.0):
        self.model, self.host, self.port = model, host, port or free_port(host)
        self.tmpdir, self.extra_env, self.args = tmpdir, dict(env or {}), tuple(args)
        self.log_path = log_path or os.path.join(tmpdir or ".", f"vllm-serve-{self.port}.log")
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.leftover: list[str] = []
        """What of the server's process group was still running after its clean stop (then killed): ``pid name``."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def status_dir(self) -> str:
        """The server's default status folder (``status``): ``{TMPDIR}/shardsync-vllm/pid{pid of vllm serve}``."""
        from ...integrations.vllm.status import ROOT_NAME

        import tempfile
        return os.path.join(self.tmpdir or tempfile.gettempdir(), ROOT_NAME, f"pid{self.pid}")

    def command(self) -> list[str]:
        return [*vllm_command(), "serve", self.model, "--host", self.host, "--port", str(self.port),
                "--enforce-eager", "--max-model-len", "128", "--skip-tokenizer-init",
                "--weight-transfer-config", json.dumps({"backend": "shardsync"}), *self.args]

    def start(self) -> "VllmServer":
        import requests

        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1",
               **({"TMPDIR": self.tmpdir} if self.tmpdir else {}), **self.extra_env}
        if self.tmpdir:
            os.makedirs(self.tmpdir, exist_ok=True)
        log = open(self.log_path, "ab")
        try:  # its own process group: stop() can reach every process it started
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                self.stop(timeout_s=10)
                raise RuntimeError(f"vllm serve did not come up within {self.start_timeout_s:.0f} s (exit code "
                                   f"{code}); its log {self.log_path}:\n{self.log_tail()}")
            time.sleep(1)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """A clean stop (SIGINT to ``vllm serve``, as Ctrl-C; vLLM shuts its engine core and workers down), then
        SIGKILL to whatever of its process group is left (after ``timeout_s``, or at once for stragglers once the
        server exited). Returns the server's exit code. Idempotent."""
        proc = self.proc
        if proc is None:
            return self.returncode
        pgid = proc.pid  # start_new_session: the group is the server's pid
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _killpg(pgid)
                proc.wait(timeout=30)
        deadline = time.monotonic() + 15  # its children exit after it: give them a moment, then no orphans
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.leftover = [f"{pid} {name}" for pid, name in _group_members(pgid)]
        _killpg(pgid)
        deadline = time.monotonic() + 15  # killed orphans are reaped by init
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.returncode, self.proc = proc.returncode, None
        return self.returncode

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---------------------------------------------------------------- requests
    def completion(self, prompt_ids: list[int], *, max_tokens: int = 8, timeout_s: float = 120.0) -> Any:
        """``POST /v1/completions`` with a token-id prompt, greedy; the ``requests`` response."""
        import requests

        return requests.post(f"{self.url}/v1/completions", timeout=timeout_s, json={
            "model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, "detokenize": False})

    def completion_tokens(self, prompt_ids: list[int], *, max_tokens: int = 8) -> list[int]:
        r = self.completion(prompt_ids, max_tokens=max_tokens)
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions answered HTTP {r.status_code}: {r.text[:2000]}")
        return list(r.json()["choices"][0]["token_ids"])

    def weight_version(self) -> str:
        import requests

        return str(requests.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"])


def _group_members(pgid: int) -> list[tuple[int, str]]:
    """Live (not zombie) processes of process group ``pgid`` (Linux ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(rest[2]) == pgid and rest[0] != "Z":
            found.append((int(entry), name))
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
