"""`prfaas bench` (and `tour`, `region`) refuse bad options and a missing deployment with exit 2 and a clear
line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prfaas.devstack.stack import Stack
from prfaas.devstack.state import UpState, write_state
from prfaas.engine.models import prepare_model


def _bench(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PRFAAS_HOME": str(home), "COLUMNS": "200"}
    env.pop("PRFAAS_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "prfaas.cli.main", "bench", *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], "no deployment to bench: run `prfaas up` first"),
        (["--input-len", "gauss:3"], "--input-len: 'gauss:3' is not fixed:N, uniform:LO-HI or lognormal"),
        (["--compare", "colocated,fastest"], "unknown policy fastest; known: colocated, split-always, prfaas"),
        (["--rate", "2", "--concurrency", "3"], "--rate (open loop) and --concurrency (closed loop) exclude"),
        (["--mix", "nope"], "--mix: unknown mix 'nope'; known: chat-rag, chat-agent"),
        (["--timeout-s", "0"], "Invalid value for '--timeout-s': 0.0 is not in the range x>=1.0"),  # every request
        # failed before
        (["--rate", "nan"], "--rate: requests per second must be a positive number, not nan"),  # passed before
        (["--burstiness", "nan"], "--burstiness: the CV of gaps must be a positive number"),  # a hang in plan()
        (["--max-duration-s", "-1"], "--max-duration-s: seconds must be a positive number"),
        (["--timeout-s", "nan"], "--timeout-s and --think-s: finite numbers of seconds"),  # passed typer's min
        # NaN made bench.json invalid JSON; a target <= 0 counts no request as good
        (["--slo-ttft-ms", "nan"], "--slo-ttft-ms: a target must be a positive number of milliseconds, not nan"),
        (["--slo-tpot-ms", "-5"], "--slo-tpot-ms: a target must be a positive number of milliseconds, not -5.0"),
        (["--slo-ttft-ms", "0"], "--slo-ttft-ms: a target must be a positive number of milliseconds, not 0.0"),
        (["--warmup", "-1"], "Invalid value for '--warmup': -1 is not in the range x>=0"),
    ],
)
def test_bad_bench_options_exit_2_with_a_clear_message(args: list[str], expected: str, tmp_path: Path) -> None:
    out = _bench(args, tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert expected in out.stdout + out.stderr  # typer's own range errors go to stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["tour", "-n", "0"], "Invalid value for '--num-requests' / '-n': 0 is not in the range x>=1"),  # after part 1
        (
            ["region", "--config", "r.yaml", "--log-level", "verbose"],  # a ValueError traceback before
            "error: --log-level verbose: one of DEBUG, INFO, WARNING, ERROR",
        ),
    ],
)
def test_other_bad_options_exit_2_before_anything_runs(args: list[str], expected: str, tmp_path: Path) -> None:
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path), "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "prfaas.cli.main", *args], env=env, capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode == 2 and expected in out.stdout + out.stderr, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize("command", [["bench"], ["tour"]])
def test_a_corrupt_state_file_is_one_line_not_a_traceback(command: list[str], tmp_path: Path) -> None:
    (tmp_path / "up.json").write_text("{not json")
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path), "COLUMNS": "300"}
    env.pop("PRFAAS_API_KEY", None)
    out = subprocess.run([sys.executable, "-m", "prfaas.cli.main", *command], env=env, capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.startswith(f"error: {tmp_path / 'up.json'} is not a prfaas up state file (")
    assert out.stdout.count("\n") == 1 and "Traceback" not in out.stdout + out.stderr


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The real API process (no region: /v1/models needs none)."""
    prepare_model("tiny-llama")
    stack = Stack(tmp_path_factory.mktemp("api"))
    try:
        stack.start_api()
        yield stack
    finally:
        stack.stop()
        stack.cleanup()


def test_bench_and_tour_say_the_key_was_refused_in_one_line(api: Stack, tmp_path: Path) -> None:
    """A wrong or revoked key is the key refused, not 'cannot reach' with httpx's two-line text; a closed port is
    'cannot reach'. Before, both were `cannot reach .../models: Client error '401 Unauthorized' ...` and a second
    line pointing at developer.mozilla.org."""
    refused = f"error: {api.url}/v1 refused the API key (HTTP 401: "
    out = _bench(["--api-base", f"{api.url}/v1", "--api-key", "pfk-wrong"], tmp_path)
    assert out.returncode == 2 and out.stdout.startswith(refused), out.stdout + out.stderr
    assert out.stdout.count("\n") == 1, out.stdout
    state = UpState(api_base=f"{api.url}/v1", api_key="pfk-wrong", admin_key="a", dashboard_url="", url=api.url,
                    tenant_id="t", topology="", redis_url="", key_prefix="p", registry="", log_dir="",
                    emulate_wan=False)  # fmt: skip
    write_state(tmp_path, state)
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path), "COLUMNS": "200"}
    tour = subprocess.run([sys.executable, "-m", "prfaas.cli.main", "tour", "--no-fleet"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert tour.returncode == 2 and tour.stdout.startswith(refused), tour.stdout + tour.stderr
    assert tour.stdout.count("\n") == 1, tour.stdout
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _bench(["--api-base", f"http://127.0.0.1:{port}/v1", "--api-key", "k"], tmp_path / "b")
    assert out.returncode == 2 and out.stdout.startswith(f"error: cannot reach http://127.0.0.1:{port}/v1/models: ")
    assert out.stdout.count("\n") == 1, out.stdout
    out = _bench(["--api-base", "http://localhost:abc/v1", "--api-key", "k"], tmp_path / "c")  # a traceback before
    assert out.returncode == 2 and out.stdout.startswith("error: 'http://localhost:abc/v1' is not a URL the API can")
    assert "Traceback" not in out.stdout + out.stderr
