"""bench/transport_matrix.py: its argument checks (before any namespace or process is made) and its
role processes' reads, which have a deadline (a silent role used to block the run forever)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from bench_kit import python, script, unusable_home


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "--rounds 0: at least 1"),
        (["--shipments", "0"], "--shipments 0: at least 1"),
        # shm and inproc never cross the link: nothing would be left to run (a division by zero)
        (["--wan", "continental", "--systems", "shm", "inproc"], "--wan: inproc, shm run on one host only"),
    ],
)
def test_nothing_to_measure_is_a_usage_error(tmp_path: Path, args: list[str], message: str) -> None:
    done = script("transport_matrix.py", *args, env=unusable_home(tmp_path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr


def test_a_silent_role_is_killed_at_the_reads_deadline() -> None:
    started = time.monotonic()
    got = python(
        "import json, os, time\n"
        "from prfaas.bench.transport_matrix import Peer\n"
        "peer = Peer(['sleep', '60'], dict(os.environ))\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    peer.read(timeout_s=0.5)\n"
        "    error = None\n"
        "except RuntimeError as exc:\n"
        "    error = str(exc)\n"
        "print(json.dumps({'error': error, 'waited_s': time.monotonic() - t, 'exit': peer.p.poll()}))\n",
        timeout_s=30,
    )
    assert got["error"] and "silent for 0.5 s; killed" in got["error"]
    assert 0.4 < got["waited_s"] < 5  # the deadline, not the 60 s the role stays silent
    assert got["exit"] is not None  # killed, not left running
    assert time.monotonic() - started < 30
