"""`prfaas bench --compare` end to end against a fake API on loopback (a real `prfaas bench` process; only its
prompt corpus is stubbed, so no model need be prepared): the ratio table shows each policy's completed/failed
requests beside its ratios, and Ctrl-C during the second policy writes the first's figures with
`"interrupted": true` and exits 130 (before: click's "Aborted!", exit 1, nothing written)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from api_kit import answer, event, fake_api, stream_events

# `prfaas bench` with the corpus stubbed (loadgen.bench.corpus tokenizes with a prepared model's tokenizer)
STUBBED = ("import sys, prfaas.loadgen.bench as b; b.corpus = lambda model: (list(range(1000, 3000)), 2048); "
           "from prfaas.cli.main import app; sys.argv[0] = 'prfaas'; app()")  # fmt: skip


def _bench(url: str, out: Path, policies: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PRFAAS_HOME": str(out / "home"), "COLUMNS": "200"}
    args = ["bench", "--api-base", url, "--api-key", "k", "--model", "m", "-n", "2", "--concurrency", "1",
            "--warmup", "0", "--input-len", "fixed:8", "--output-len", "fixed:2", "--compare", policies,
            "--out", str(out)]  # fmt: skip
    # as from a terminal: a test run started in the background (CI) ignores SIGINT, and its children with it
    return subprocess.Popen([sys.executable, "-c", STUBBED, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip


def test_the_ratio_table_shows_each_policys_completed_and_failed_requests(tmp_path: Path) -> None:
    split_seen: list[int] = []

    def reply(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        if body["prfaas"]["placement"] == "split":  # split-always: its second request is cut short
            split_seen.append(1)
            if len(split_seen) == 2:
                stream_events(handler, [event("x")], done=False)
                return
        answer(handler, body)

    with fake_api(reply) as api:
        proc = _bench(api.url, tmp_path, "colocated,split-always")
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    ratios = output[output.index("ratio to colocated") :]
    rows = {line.split()[1]: line for line in ratios.splitlines() if "colocated" in line or "split-always" in line}
    assert "2/0" in rows["colocated"] and "1/1" in rows["split-always"], ratios
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["interrupted"] is False
    assert set(bench["ratios"]["split-always"]) == {"TTFT P50", "TTFT P90", "TPOT P50", "E2E P90",
                                                    "throughput tok/s", "goodput req/s", "$ / 1M tokens"}  # fmt: skip


def test_ctrl_c_keeps_the_policies_that_finished_and_exits_130(tmp_path: Path) -> None:
    holder: list[subprocess.Popen[str]] = []
    interrupted = threading.Event()

    def reply(handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        if body["prfaas"]["placement"] == "local":  # colocated runs to its end
            answer(handler, body)
            return
        if not interrupted.is_set():  # prfaas: its first request is under way when Ctrl-C comes
            interrupted.set()
            holder[0].send_signal(signal.SIGINT)
        stream_events(handler, (event("x") for _ in range(100)), pause_s=0.1)  # until the client hangs up

    with fake_api(reply) as api:
        holder.append(_bench(api.url, tmp_path, "colocated,prfaas"))
        output, _ = holder[0].communicate(timeout=60)
    assert holder[0].returncode == 130, output
    assert "1 of 2 policies finished (colocated)" in output and "Traceback" not in output, output
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["interrupted"] is True
    assert list(bench["policies"]) == ["colocated"] and bench["policies"]["colocated"]["completed"] == 2
    trace = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [row["policy"] for row in trace] == ["colocated", "colocated"]


def test_a_policy_named_twice_in_compare_is_a_usage_error(tmp_path: Path) -> None:
    # before: run twice, bench.json kept the second run's figures, trace.jsonl both runs' rows under one name
    with fake_api(answer) as api:
        proc = _bench(api.url, tmp_path, "colocated,prfaas,colocated")
        output, _ = proc.communicate(timeout=60)
        sent = len(api.bodies)
    assert proc.returncode == 2, output
    assert output.strip().splitlines() == ["error: --compare: colocated named more than once; each policy runs once"]
    assert sent == 0 and not (tmp_path / "bench.json").exists()
