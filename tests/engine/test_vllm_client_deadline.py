"""Every `VLLMClient` call has a deadline, its connect and HMAC handshake included (engine/vllm/server.py
`_connect`): a vLLM server process alive but stalled (its listen backlog takes the connection, nobody runs
the challenge) is a TimeoutError at the call's deadline (a `WorkerTimeout` from `VLLMEngine`), not a wait
for ever. No vLLM here: the stalled server is a socket that listens and never accepts, the live one
`_serve_one` over a stand-in host. (A real vLLM server: tests/vllm.)"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import pytest

from prfaas.engine.base import ModelFacts
from prfaas.engine.errors import WorkerTimeout
from prfaas.engine.vllm import server
from prfaas.engine.vllm.remote import VLLMEngine
from prfaas.engine.vllm.server import StreamStopped, VLLMClient

AUTHKEY = os.urandom(16)


@pytest.fixture
def stalled() -> Iterator[VLLMClient]:
    """A client of a server whose control port takes connections into its backlog and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:  # never accept()ed
        yield VLLMClient(listener.getsockname(), AUTHKEY)


def _within(seconds: float, call: Callable[[], Any]) -> BaseException | Any:
    """What `call` returned or raised, run on a thread given `seconds`: one that blocks fails the test
    instead of hanging it (a daemon thread, left blocked)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    return outcome[0]


def test_a_call_to_a_stalled_server_times_out_at_its_deadline(stalled: VLLMClient) -> None:
    started = time.monotonic()
    outcome = _within(5.0, lambda: stalled.num_free_blocks(timeout_s=0.5))
    assert isinstance(outcome, TimeoutError), outcome
    assert time.monotonic() - started < 2.0  # 0.5 s, not the 30 s of a control call


def test_a_long_calls_handshake_waits_no_longer_than_the_control_timeout(
    stalled: VLLMClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wait_shipped(60 s) waits up to 65 s for its answer, but a server that cannot even answer the challenge
    within CONTROL_TIMEOUT_S is stalled, not busy."""
    monkeypatch.setattr(server, "CONTROL_TIMEOUT_S", 0.5)
    outcome = _within(5.0, lambda: stalled.wait_shipped({"prfaas_ship": {}}, 60.0))
    assert isinstance(outcome, TimeoutError), outcome


def test_a_stream_to_a_stalled_server_times_out(stalled: VLLMClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "CONTROL_TIMEOUT_S", 0.5)
    outcome = _within(5.0, lambda: next(stalled.stream([1, 2, 3], 1, timeout_s=60.0)))
    assert isinstance(outcome, TimeoutError), outcome


def test_a_stream_stopped_before_it_starts_ends_without_connecting(stalled: VLLMClient) -> None:
    stop = threading.Event()
    stop.set()  # the job was canceled before its stream started
    outcome = _within(5.0, lambda: next(stalled.stream([1, 2, 3], 1, stop, timeout_s=60.0)))
    assert isinstance(outcome, StreamStopped), outcome


def test_the_engine_reports_a_stalled_server_as_a_worker_timeout(stalled: VLLMClient, tmp_path: Path) -> None:
    """DEADLINE_EXCEEDED for the caller (VLLMEngine._call maps TimeoutError to WorkerTimeout)."""
    facts = ModelFacts("f" * 64, "float32", 1000, 2, 1, 8, 4096, frozenset({0}))
    proc = subprocess.Popen(["sleep", "60"])  # the server process: alive, so not EngineUnavailable
    engine = VLLMEngine(facts, proc, stalled, None, tmp_path / "log", tmp_path)
    try:
        outcome = _within(5.0, lambda: engine.cancel_shipment({"prfaas_ship": {}}, timeout_s=0.5))
        assert isinstance(outcome, WorkerTimeout), outcome
    finally:
        engine.close()


@dataclass
class _Generation:
    token_ids: list[int]


class _Host:
    """What `_serve_one` calls on a VLLMHost for the calls below."""

    def num_free_blocks(self) -> int:
        return 7

    def generate(self, token_ids: list[int], max_tokens: int, **_options: object) -> _Generation:
        return _Generation(token_ids[::-1])


def test_a_live_server_answers_within_the_deadline() -> None:
    """The handshake and the request still work with the deadline on them, a request and a reply of a few MB
    (written and read in many pieces) included."""
    with Listener(("127.0.0.1", 0)) as listener:  # authenticated per connection, as the server's

        def serve() -> None:
            for _ in range(2):
                server._serve_one(_Host(), listener.accept(), AUTHKEY)

        threading.Thread(target=serve, daemon=True).start()
        client = VLLMClient(listener.address, AUTHKEY)
        assert _within(10.0, lambda: client.num_free_blocks(timeout_s=5.0)) == 7
        prompt = list(range(500_000))
        reply = _within(20.0, lambda: client.generate(prompt, 1, timeout_s=10.0))
        assert reply == {"token_ids": prompt[::-1]}


def test_a_reply_that_starts_and_stalls_is_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that sends the head of its reply and stalls: the read gives up after CONTROL_TIMEOUT_S as a
    TimeoutError (the engine's WorkerTimeout), not the socket's BlockingIOError (read as a server gone)."""
    monkeypatch.setattr(server, "CONTROL_TIMEOUT_S", 1.0)
    listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
    held: list[Any] = []

    def serve() -> None:
        conn = listener.accept()
        held.append(conn)
        conn.recv()
        os.write(conn.fileno(), (1000).to_bytes(4, "big") + b"\x80")  # 1 byte of a 1,000-byte reply, then nothing

    threading.Thread(target=serve, daemon=True).start()
    client = VLLMClient(listener.address, AUTHKEY)
    try:
        outcome = _within(10, lambda: client.num_free_blocks(timeout_s=8))
        assert isinstance(outcome, TimeoutError), outcome
    finally:
        for conn in held:
            conn.close()
        listener.close()
