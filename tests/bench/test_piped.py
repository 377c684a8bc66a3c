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


def test_a_reply_that_is_not_an_object_is_skipped() -> None:
    code = "print(42); print('[1, 2]'); print('{\"ready\": true}')"
    got = python(READ, [["python3", "-c", code], 10], timeout_s=30)
    assert got["reply"] == {"ready": True}


AGAIN = (
    "import json, subprocess, sys, time\n"
    "from prfaas.bench.piped import Piped\n"
    "proc = Piped(['python3', '-c', 'pass'])\n"
    "errors = []\n"
    "for _ in range(2):\n"
    "    t = time.monotonic()\n"
    "    try:\n"
    "        proc.read(3)\n"
    "    except RuntimeError as exc:\n"
    "        errors.append([str(exc), time.monotonic() - t])\n"
    "try:\n"
    "    proc.send({'cmd': 'go'})\n"
    "    sent = 'sent'\n"
    "except RuntimeError as exc:\n"
    "    sent = str(exc)\n"
    "print(json.dumps({'errors': errors, 'sent': sent}))\n"
)


def test_a_process_that_exited_says_so_at_every_read_and_send() -> None:
    """The second read of an exited process raises at once too (it waited its whole timeout, then said
    "silent ... killed"); a send to it is a RuntimeError, as documented, not a BrokenPipeError."""
    got = python(AGAIN, timeout_s=30)
    assert [("exited with 0" in e, s < 2) for e, s in got["errors"]] == [(True, True), (True, True)], got
    assert "is gone" in got["sent"], got
