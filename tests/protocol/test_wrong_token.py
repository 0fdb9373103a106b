"""A wrong token is named at once (issue 35, item 7).

An engine started with another token than the producers' fails its handshake at once (``AuthError``); the producer
logs the first refusal from each source address at once (the peer, "wrong token"), and while its quorum is missing
its init error names the refused connections — not a bare timeout after ``init_timeout_s``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import pytest

from shardsync.engine.protocol import control
from shardsync.engine.protocol import messages as m
from shardsync.engine.protocol.control import ControlClient, ControlServer
from shardsync.engine.producer.producer import Producer, ProducerConfig
from shardsync.errors import AuthError, TransportError
from shardsync.source import ModuleSource
from shardsync.testing.zoo import ZooConfig, hf_state_dict

CFG = ZooConfig.qwen3_moe_tiny(layers=1)
TOKEN = "the-right-token"

_ENGINE = """
import json, sys
from shardsync.engine.consumer.consumer import Consumer
out = []
for i in range(2):  # an engine that retries: two connections, both refused
    c = Consumer(f"r{i}/tp0", json.loads(sys.argv[1]), token="a-wrong-token", record=None, apply=None, init_timeout_s=5)
    try:
        c.init()
        out.append("no error")
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}")
print(json.dumps(out))
"""


@pytest.mark.procs
def test_a_wrong_token_is_logged_at_once_and_named_by_the_init_error(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="shardsync.control")
    p = Producer(ModuleSource(hf_state_dict(CFG, seed=0)),
                 ProducerConfig(rank=0, n_producers=1, n_consumers=1, token=TOKEN, lease_s=2.0, timeout_s=10.0,
                                init_timeout_s=8.0, max_chunk_bytes=32 << 10))
    err: list[BaseException] = []

    def init() -> None:
        try:
            p.init()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            err.append(e)

    th = threading.Thread(target=init, daemon=True)
    t0 = time.monotonic()
    th.start()
    try:
        eng = subprocess.run([sys.executable, "-c", _ENGINE, json.dumps(p.address)], capture_output=True, text=True,
                             timeout=120)
        assert eng.returncode == 0, eng.stderr[-3000:]
        errors = json.loads(eng.stdout.strip().splitlines()[-1])
        assert all(e.startswith("AuthError") and "refused this connection's token" in e for e in errors), errors
        # the producer said so at once: the peer's address and the cause, once for that address
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not [r for r in caplog.records if "wrong token" in r.getMessage()]:
            time.sleep(0.05)
        said = [r.getMessage() for r in caplog.records if "wrong token" in r.getMessage()]
        assert len(said) == 1, said
        assert "127.0.0.1:" in said[0] and "refused a connection from" in said[0], said
        assert time.monotonic() - t0 < p.cfg.init_timeout_s  # before init gave up
        assert th.is_alive()  # still waiting for its quorum
        th.join(30)
        assert not th.is_alive() and err, "init did not fail"
        e = err[0]
        assert isinstance(e, TransportError), repr(e)
        text = str(e)
        assert "not heard from: 1" in text and "refused: 2 connections with a wrong token from 127.0.0.1:" in text, text
        assert text.count("127.0.0.1:") == 2, text
        assert p.server.refused["token"] == 2 and p.server.admission.refused["token"] == 2
    finally:
        p.close()


def test_refusals_are_bounded_per_address_and_in_what_they_name(monkeypatch, caplog) -> None:
    """Peers are untrusted: the addresses logged once each are a bounded table (past it: counted, rate-limited log),
    and ``refusals()`` names the newest few connections only."""
    monkeypatch.setattr(control, "REFUSED_HOSTS", 1)
    caplog.set_level(logging.WARNING)
    srv = ControlServer("0.0.0.0", 0, TOKEN, lambda msg: m.Ack(), advertise_host="127.0.0.1")
    try:
        assert srv.refusals() == ""
        for _ in range(3):
            with pytest.raises(AuthError):
                ControlClient(srv.address, "wrong", peer="server")
        import socket

        try:  # a second source address (any 127/8 address is loopback on Linux)
            s = socket.create_connection(("127.0.0.1", srv.address[1]), source_address=("127.0.0.2", 0), timeout=5)
            s.close()
        except OSError:
            pytest.skip("no second loopback source address here")
        from shardsync.security.handshake import client_auth

        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", srv.address[1]), source_address=("127.0.0.2", 0), timeout=5)
            with pytest.raises(AuthError):
                client_auth(s, "wrong", peer="server")
            s.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and srv.refused["token"] < 6:
            time.sleep(0.05)
        assert srv.refused["token"] == 6
        first = [r.getMessage() for r in caplog.records if "refused a connection from" in r.getMessage()]
        assert len(first) == 1 and "127.0.0.1:" in first[0], first  # once for the address in the table
        past = [r.getMessage() for r in caplog.records if "127.0.0.2" in r.getMessage()]
        assert 1 <= len(past) <= 3, past  # past the table: through the rate-limited refusal log
        named = srv.refusals()
        assert named.startswith("6 connections with a wrong token from ") and named.endswith(", ..."), named
        assert named.count("127.0.0.") == control.REFUSED_KEPT, named
    finally:
        srv.close()
