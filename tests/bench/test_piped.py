"""bench/piped.py, the pipes every transport bench drives its role processes over: JSON lines, and a
read that gives up at its deadline and kills the process (a pipe's readline has none)."""

from __future__ import annotations

from bench_kit import python

READ = (
    "import json, os, sys, subprocess, time\n"
    "from prfaas.bench.piped import Piped\n"
    "argv, timeout_s = json.load(sys.stdin)\n"
    "started = []\n"
    "def start(argv, **kwargs):  # as transport_wan starts its roles: in a namespace, by the link\n"
    "    started.append(argv)\n"
    "    return subprocess.Popen(argv, **kwargs)\n"
    "proc = Piped(argv, dict(os.environ), start)\n"
    "t = time.monotonic()\n"
    "try:\n"
    "    reply, error = proc.read(timeout_s), None\n"
    "except RuntimeError as exc:\n"
    "    reply, error = None, str(exc)\n"
    "waited_s = time.monotonic() - t\n"
    "time.sleep(0.2)\n"
    "print(json.dumps({'reply': reply, 'error': error, 'waited_s': waited_s, 'exit': proc.p.poll(),"
    " 'started': started}))\n"
)


def test_a_silent_process_is_killed_at_the_deadline() -> None:
    got = python(READ, [["sleep", "60"], 0.5], timeout_s=30)
    assert "silent for 0.5 s; killed" in got["error"]
    assert 0.4 < got["waited_s"] < 5
    assert got["exit"] is not None
    assert got["started"] == [["sleep", "60"]]  # through the given start


def test_lines_that_are_not_json_are_skipped() -> None:
    code = "print('a library says hello'); print('{\"ready\": true}')"
    got = python(READ, [["python3", "-c", code], 10], timeout_s=30)
    assert got["reply"] == {"ready": True}
    assert got["error"] is None


def test_a_process_that_exits_without_replying_is_an_error_at_once() -> None:
    got = python(READ, [["python3", "-c", "raise SystemExit(3)"], 30], timeout_s=30)
    assert "exited with 3" in got["error"]
    assert got["waited_s"] < 10
