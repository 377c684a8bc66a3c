"""Starting a region's vLLM server (engine/vllm/remote.py) when it cannot start: a missing
interpreter, a server that exits, one that is never ready. Each is an EngineUnavailable
within its deadline, and no process is left behind. (A real vLLM server: tests/vllm.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from prfaas.engine.device import select_device
from prfaas.engine.errors import EngineUnavailable
from prfaas.engine.models import prepare_model
from prfaas.engine.vllm.remote import DEFAULT_VLLM_PYTHON, ServerOptions, cuda_of, start_vllm_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _model() -> None:
    prepare_model("tiny-llama")


def _script(folder: Path, body: str) -> Path:
    path = folder / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_the_default_interpreter_is_the_one_make_vllm_install_makes() -> None:
    assert DEFAULT_VLLM_PYTHON == ROOT / ".venv-vllm" / "bin" / "python"  # the Makefile's VLLM_VENV, at the root


def test_device_and_dtype_follow_the_vllm_environments_torch(tmp_path: Path) -> None:
    """This host's own torch is a CPU build; the vLLM environment's sees two GPUs: its server runs
    on the GPU, so `auto` picks cuda:0 in bfloat16 (not the CPU's float32)."""
    gpus = cuda_of(_script(tmp_path, 'echo \'["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]\''))
    choice = select_device("auto", "auto", gpus)
    assert (choice.device, choice.dtype, choice.name) == ("cuda:0", "bfloat16", "NVIDIA H100 80GB HBM3")
    assert select_device("auto", "auto", cuda_of(Path(sys.executable))).device == "cpu"  # this one: a CPU torch


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("echo 'ModuleNotFoundError: No module named torch' >&2; exit 1", r"\(exit 1\): ModuleNotFoundError"),
        ("echo not json", r"could not say which GPUs"),
        ("sleep 30", r"within 0.5 s"),
    ],
)
def test_a_vllm_environment_that_cannot_say_its_gpus_is_unavailable(tmp_path: Path, body: str, message: str) -> None:
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match=message):
        cuda_of(_script(tmp_path, body), timeout_s=0.5)
    assert time.monotonic() - started < 10


def test_missing_interpreter_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailable, match=r"is not an executable file: run `make vllm-install`"):
        start_vllm_engine("tiny-llama", options=ServerOptions(python=tmp_path / "absent" / "python"))


def test_server_that_exits_during_startup_is_reported_with_its_log(tmp_path: Path) -> None:
    python = _script(tmp_path, 'echo "ModuleNotFoundError: No module named vllm"; exit 1')
    with pytest.raises(EngineUnavailable) as info:
        start_vllm_engine("tiny-llama", options=ServerOptions(python=python, log_path=tmp_path / "server.log"))
    assert "exited with 1 during start-up" in str(info.value)
    assert "No module named vllm" in str(info.value)


def test_server_never_ready_fails_at_its_deadline_and_is_stopped(tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    python = _script(tmp_path, f"echo $$ > {marker}; exec sleep 60")
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match=r"not ready in 1 s"):
        start_vllm_engine("tiny-llama", options=ServerOptions(python=python, start_timeout_s=1.0))
    assert time.monotonic() - started < 15
    pid = int(marker.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_server_whose_engine_died_exits_so_its_region_sees_it_gone() -> None:
    """The host's loop ends when engine.step() raises; every call would fail from then on. The server's
    watch exits with EXIT_ENGINE_DIED instead (the region's `on_exit` then takes it out of the fleet)."""
    code = (
        "import threading, types\n"
        "from prfaas.engine.vllm.server import _exit_when_dead\n"
        "host = types.SimpleNamespace(died=threading.Event(), failure=RuntimeError('CUDA error'))\n"
        "threading.Timer(0.1, host.died.set).start()\n"
        "_exit_when_dead(host)\n"
        "raise SystemExit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "the vLLM engine died (RuntimeError('CUDA error'))" in done.stderr


def test_a_stream_whose_tokens_keep_coming_still_ends_at_its_deadline() -> None:
    """The server's stream loop checked its deadline only after 50 ms without a token: a request that
    streams a token every 20 ms ran past it for as long as it generated."""
    import multiprocessing
    import threading
    from concurrent.futures import Future

    from prfaas.engine.vllm.server import _stream

    class Host:  # a VLLMHost's surface as _stream uses it, generating a step every 20 ms until aborted
        def __init__(self) -> None:
            self.aborted = threading.Event()

        def submit(self, *_args: object, on_tokens: Any, **_kw: object) -> Future[Any]:
            def generate() -> None:
                while not self.aborted.wait(0.02):
                    on_tokens([(1, None, None)])

            threading.Thread(target=generate, daemon=True).start()
            return Future()

        def abort(self, _request_id: str) -> None:
            self.aborted.set()

    host = Host()
    ours, theirs = multiprocessing.Pipe()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish in 0\.5 s"):
        _stream(host, ours, [1, 2, 3], 100, None, 0.5, None)
    assert time.monotonic() - started < 1.5 and host.aborted.is_set()
    theirs.close()
