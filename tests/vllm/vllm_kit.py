"""Launching the vLLM engine processes the vLLM tests share (see conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prfaas.engine.vllm.server import AUTHKEY_ENV, VLLMClient
from prfaas.transport.tickets import TicketSigner

MODEL = "smollm2-135m"
START_TIMEOUT_S = 420.0


@dataclass
class VLLMProcess:
    name: str
    proc: subprocess.Popen[bytes]
    client: VLLMClient
    kv_endpoint: str
    log: Path


@dataclass
class VLLMPair:
    prefill: VLLMProcess
    decode: VLLMProcess
    signer: TicketSigner


def start(name: str, tmp: Path, authkey: bytes, ticket_key: bytes) -> tuple[subprocess.Popen[bytes], Path, Path]:
    ready, log = tmp / f"{name}.ready", tmp / f"{name}.log"
    env = {
        **os.environ,
        AUTHKEY_ENV: authkey.hex(),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    cmd = [sys.executable, "-m", "prfaas.engine.vllm.server", "--model", MODEL, "--node", name]
    cmd += ["--ticket-key", f"k1:{ticket_key.hex()}", "--ready-file", str(ready)]
    cmd += ["--enforce-eager"]  # no torch.compile: ~45 s start-up instead of ~160 s here
    cmd += ["--exit-with-parent"]  # an interrupted test session leaves no vLLM behind
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, ready, log


def wait_ready(name: str, proc: subprocess.Popen[bytes], ready: Path, log: Path, deadline: float) -> dict[str, list]:
    while time.monotonic() < deadline:
        if ready.exists():
            return dict(json.loads(ready.read_text()))
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vLLM process {name} exited with {proc.returncode} during start-up:\n{tail}")
        time.sleep(0.5)
    raise TimeoutError(f"vLLM process {name} not ready in {START_TIMEOUT_S} s (log: {log})")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
