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
from prfaas.transport.identity import Identity, server_name
from prfaas.transport.tickets import TicketSigner
from prfaas.transport.tls import NodeCert, init_certs

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
    """Two engines whose KV links speak mutual TLS: the prefill's certificate names a prefill
    region, the decode's a decode region (`certs`, with `stranger`: a decode-region identity
    from the same CA, which a KV receiver refuses)."""

    prefill: VLLMProcess
    decode: VLLMProcess
    signer: TicketSigner
    certs: dict[str, NodeCert]

    @property
    def decode_server_name(self) -> str:
        return server_name(DECODE_REGION)


DECODE_REGION = "vllm-decode"


def make_certs(tmp: Path) -> dict[str, NodeCert]:
    identities = {
        "prefill": Identity("prefill", "vllm-prefill", "1"),
        "decode": Identity("decode", DECODE_REGION, "1"),
        "stranger": Identity("decode", "vllm-other", "1"),
    }
    _ca, nodes = init_certs(tmp / "certs", list(identities), ["127.0.0.1"], identities=identities)
    return dict(zip(identities, nodes, strict=True))


def start(
    name: str, tmp: Path, authkey: bytes, ticket_key: bytes, tls: NodeCert | None = None
) -> tuple[subprocess.Popen[bytes], Path, Path]:
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
    if tls is not None:
        cmd += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]
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
