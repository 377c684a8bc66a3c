"""Two vLLM engine processes with the prfaas connector, shared by every vLLM test (start-up
is the cost: 45-160 s each on this CPU, so they start together, once per session). Their KV
links speak mutual TLS (certificates from `prfaas certs init`'s code, with identities); the
regions of test_regions_on_vllm.py run plaintext, so both paths are exercised."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
from vllm_kit import MODEL, START_TIMEOUT_S, VLLMClient, VLLMPair, VLLMProcess, make_certs, start, stop, wait_ready

from prfaas.engine.models import prepare_model
from prfaas.transport.tickets import TicketSigner


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMPair]:
    prepare_model(MODEL)
    tmp = tmp_path_factory.mktemp("vllm")
    authkey, ticket_key = secrets.token_bytes(32), secrets.token_bytes(32)
    certs = make_certs(tmp)
    started = {name: start(name, tmp, authkey, ticket_key, certs[name]) for name in ("prefill", "decode")}
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        processes = {}
        for name, (proc, ready, log) in started.items():
            info = wait_ready(name, proc, ready, log, deadline)
            host, port = info["control"]
            kv_host, kv_port = info["kv"]
            processes[name] = VLLMProcess(name, proc, VLLMClient((host, port), authkey), f"{kv_host}:{kv_port}", log)
        yield VLLMPair(processes["prefill"], processes["decode"], TicketSigner({"k1": ticket_key}, "k1"), certs)
    finally:
        for proc, _ready, _log in started.values():
            stop(proc)
