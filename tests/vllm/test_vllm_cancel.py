"""A vLLM prefill job that ends while its shipment is on the wire takes the shipment with it (no shipment
outlives its job): `VLLMPrefill.run` against the tests' prefill vLLM server, shipping to a decode KV port
that never reads, so the shipment could only end at its deadline."""

from __future__ import annotations

import socket
import ssl
import threading
import time
import uuid
from typing import Any

import pytest
from test_vllm_split import KV_BYTES_PER_TOKEN, prompt_ids
from vllm_kit import DECODE_REGION, MODEL, VLLMPair

from prfaas.engine.vllm.params import ShipParams
from prfaas.transport.tls import NodeCert, server_context

pytestmark = pytest.mark.vllm
SHIP_TIMEOUT_S = 90.0  # the job's deadline, so its shipment's: what a shipment no one cancels runs to


class StalledPort:
    """A decode region's KV port (over TLS, with its certificate) that takes connections and never reads
    from them: a shipment to it stays in flight until it is canceled or its deadline passes."""

    def __init__(self, cert: NodeCert) -> None:
        self._tls = server_context(cert)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            self._held.append(self._tls.wrap_socket(conn, server_side=True))  # the handshake, then silence
        except (OSError, ssl.SSLError):
            conn.close()

    def close(self) -> None:
        self._listener.close()
        for conn in self._held:
            conn.close()


@pytest.mark.parametrize("how", ["canceled", "server_error"])
def test_a_job_that_ends_after_its_forward_cancels_its_shipment(vllm_pair: VLLMPair, long_text: str,
                                                                how: str) -> None:  # fmt: skip
    """`canceled`: a Cancel once the first token is out (prefill_done), while run waits for the shipment.
    `server_error`: run leaves by an error of the server's (wait_shipped raises) instead. Either way the
    server's transfer ends CANCELED within seconds, not at its deadline, and vLLM frees the prompt's blocks."""
    from prfaas.engine.base import ModelFacts
    from prfaas.engine.errors import EngineError
    from prfaas.engine.models import resolve_model
    from prfaas.engine.sampling import SamplingParams
    from prfaas.engine.vllm.remote import VLLMEngine
    from prfaas.prefill_region.backend import PrefillWork
    from prfaas.prefill_region.destination import Destination
    from prfaas.prefill_region.job import Job
    from prfaas.prefill_region.vllm_backend import VLLMPrefill
    from prfaas.region.errors import Canceled
    from prfaas.transport.endpoints import Endpoint

    server = vllm_pair.prefill
    engine = VLLMEngine(ModelFacts.read(MODEL, "float32"), server.proc, server.client, None, server.log,
                        resolve_model(MODEL))  # fmt: skip
    seen: list[dict[str, Any]] = []  # the outcome, if run read it (it then is no longer the server's to give)
    wait_shipped = engine.wait_shipped

    def spied(kv_params: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        if how == "server_error":
            raise EngineError("vLLM server: the control connection broke")
        outcome = wait_shipped(kv_params, timeout_s)
        seen.extend([outcome] if outcome is not None else [])
        return outcome

    engine.wait_shipped = spied  # type: ignore[method-assign]
    free_blocks = server.client.num_free_blocks()
    port = StalledPort(vllm_pair.certs["decode"])
    prompt = prompt_ids(long_text, 512)  # 23.6 MB of fp32 KV: far more than the sockets' buffers take
    job_id = str(uuid.uuid4())
    ticket = vllm_pair.signer.issue(job_id, 0, "tenant-a", len(prompt) * KV_BYTES_PER_TOKEN, ttl_s=120)
    destination = Destination(Endpoint("tcp", "127.0.0.1", port.port), ticket, "lossless",
                              decode_region=DECODE_REGION)  # fmt: skip
    work = PrefillWork(job_id, 0, prompt, SamplingParams(max_new_tokens=1), destination,
                       time.monotonic() + SHIP_TIMEOUT_S, ship_whole=False)  # fmt: skip
    job = Job(work, on_prefilled=lambda _tokens, _seconds: None)
    ended: list[BaseException] = []

    def run() -> None:
        try:
            VLLMPrefill(engine, ship="layerwise").run(work, job)
        except BaseException as exc:
            ended.append(exc)

    runner = threading.Thread(target=run)
    try:
        runner.start()
        if how == "canceled":
            assert job.events.get(timeout=120).HasField("prefill_done")  # the request finished: the KV ships
            time.sleep(0.5)
            job.cancel(Canceled("the test canceled the job"))
        runner.join(120)
        assert not runner.is_alive() and ended, "run returned, or ran on"
        stopped = time.monotonic()
        # wait_shipped reads the outcome by job and attempt
        ship = ShipParams(job_id, 0, ticket, f"127.0.0.1:{port.port}", "lossless").to_kv_params()
        outcome = seen[0] if seen else server.client.wait_shipped(ship, 15)
        assert outcome is not None, "the shipment ran on after its job ended"
        assert outcome["status"] == "canceled", outcome
        assert time.monotonic() - stopped < 15
        deadline = time.monotonic() + 15  # vLLM frees the blocks in a step after the transfer ended
        while server.client.num_free_blocks() != free_blocks and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.client.num_free_blocks() == free_blocks
    finally:
        job.cancel(Canceled("test over"))
        runner.join(30)
        port.close()
        engine._closing = True  # the tests' server: its exit at the session's end is no failure
