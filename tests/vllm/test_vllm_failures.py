"""Shipments that never come, or come refused: vLLM recomputes the prompt within the
request's deadline (the connector reports the blocks through
get_block_ids_with_load_errors), and no KV block is stranded on either side."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_vllm_split import prompt_ids, split
from vllm_kit import VLLMPair

from prfaas.engine.vllm.params import LoadParams, ShipParams
from prfaas.engine.vllm.server import VLLMClient
from prfaas.transport.api import Shipment, ShipmentSpec, TransferStatus
from prfaas.transport.tcp_sender import TcpChannel
from prfaas.transport.tickets import TicketSigner
from prfaas.transport.tls import client_context

pytestmark = pytest.mark.vllm


def test_missing_shipment_is_recomputed_within_its_deadline(vllm_pair: VLLMPair, long_text: str) -> None:
    prompt = prompt_ids(long_text, 600)
    reference = vllm_pair.decode.client.generate(prompt, 8)
    load = LoadParams(str(uuid.uuid4()), 0, timeout_s=3.0).to_kv_params()
    started = time.monotonic()
    result = vllm_pair.decode.client.generate(prompt, 8, kv_params=load, timeout_s=120)
    elapsed = time.monotonic() - started
    assert result["num_cached_tokens"] == 0  # nothing loaded: the prompt was computed here
    assert result["token_ids"][:8] == reference["token_ids"][:8]
    assert 3.0 <= elapsed < 3.0 + 60  # waited for the deadline, then recomputed (generous: shared CPU)


def _forged_split(pair: VLLMPair, prompt: list[int]) -> tuple[dict, dict | None]:
    """A prefill whose ticket the decode region refuses (signed with another key)."""
    job = str(uuid.uuid4())
    forged = TicketSigner({"k1": b"x" * 32}, "k1").issue(job, 0, "tenant-a", 1 << 30, ttl_s=60)
    ship = ShipParams(job, 0, forged, pair.decode.kv_endpoint, "lossless", 5.0).to_kv_params()
    load = LoadParams(job, 0, timeout_s=2.0, num_tokens=len(prompt)).to_kv_params()
    pair.decode.client.expect(job, 0, 2.0)
    first = pair.prefill.client.generate(prompt, 1, kv_params=ship)["token_ids"]
    outcome = pair.prefill.client.wait_shipped(ship, 30)
    return pair.decode.client.generate(prompt + first, 4, kv_params=load), outcome


def test_block_pools_return_to_their_start_after_20_requests(vllm_pair: VLLMPair, long_text: str) -> None:
    free_prefill = vllm_pair.prefill.client.num_free_blocks()
    free_decode = vllm_pair.decode.client.num_free_blocks()
    prompts = [prompt_ids(long_text[i * 997 :], 200 + 37 * i) for i in range(20)]

    def run(i: int) -> str:
        prompt = prompts[i]
        if i % 4 == 3:  # refused ticket: prefill fails to ship, decode recomputes
            decoded, outcome = _forged_split(vllm_pair, prompt)
            assert outcome is not None and outcome["status"] == "failed", outcome
            assert decoded["num_cached_tokens"] == 0
            return "refused"
        if i % 4 == 1:  # no prefill at all: decode waits out the deadline, recomputes
            load = LoadParams(str(uuid.uuid4()), 0, timeout_s=2.0).to_kv_params()
            decoded = vllm_pair.decode.client.generate(prompt, 4, kv_params=load)
            assert decoded["num_cached_tokens"] == 0
            return "missing"
        _tokens, decoded, outcome = split(vllm_pair, prompt, layerwise=i % 8 != 2)  # some sent after the forward
        assert outcome is not None and outcome["status"] == "completed", outcome
        assert decoded["num_cached_tokens"] == len(prompt)
        return "shipped"

    with ThreadPoolExecutor(4) as pool:
        kinds = list(pool.map(run, range(20)))
    assert kinds.count("shipped") == 10 and kinds.count("missing") == 5 and kinds.count("refused") == 5
    assert vllm_pair.prefill.client.num_free_blocks() == free_prefill
    assert vllm_pair.decode.client.num_free_blocks() == free_decode


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(vllm_pair: VLLMPair, long_text: str) -> None:
    """A decode region closes its stream when its caller goes away, at EOS or a deadline:
    the server aborts the vLLM request instead of generating on."""
    client = vllm_pair.decode.client
    free_before = client.num_free_blocks()
    steps = client.stream(prompt_ids(long_text, 300), 2000)
    first = next(steps)
    assert len(first) >= 1
    assert client.num_free_blocks() < free_before  # the request holds blocks while it runs
    steps.close()
    deadline = time.monotonic() + 30
    while client.num_free_blocks() != free_before:  # the server notices within a poll (50 ms) and aborts
        assert time.monotonic() < deadline, "the aborted request's blocks never came back"
        time.sleep(0.2)


def test_a_control_call_with_the_wrong_key_is_refused_and_the_server_serves_on(vllm_pair: VLLMPair) -> None:
    client = vllm_pair.prefill.client
    intruder = VLLMClient(client.address, b"k" * 32)
    with pytest.raises(multiprocessing.AuthenticationError):
        intruder.num_free_blocks()
    assert client.num_free_blocks() > 0


@pytest.mark.parametrize(("tenant", "max_bytes"), [("tenant-b", None), ("tenant-a", 1000)])
def test_a_shipment_for_another_tenant_or_past_the_reservation_is_refused_and_recomputed(
    vllm_pair: VLLMPair, long_text: str, tenant: str, max_bytes: int | None
) -> None:
    """The decode engine's reservation names its tenant and size (VLLMDecode.expect): the OPEN
    of a shipment whose ticket names another tenant, or whose KV is larger, is refused before
    any KV is stored; the prefill's shipment fails with TicketRejected, the decode recomputes."""
    prompt = prompt_ids(long_text, 300)
    job = str(uuid.uuid4())
    ticket = vllm_pair.signer.issue(job, 0, "tenant-a", 1 << 30, ttl_s=60)
    ship = ShipParams(job, 0, ticket, vllm_pair.decode.kv_endpoint, "lossless", 10.0, True,
                      vllm_pair.decode_server_name).to_kv_params()  # fmt: skip
    vllm_pair.decode.client.expect(job, 0, 10.0, tenant=tenant, max_bytes=max_bytes)
    first = vllm_pair.prefill.client.generate(prompt, 1, kv_params=ship)["token_ids"]
    outcome = vllm_pair.prefill.client.wait_shipped(ship, 30)
    assert outcome is not None and outcome["status"] == "failed", outcome
    assert outcome["error_type"] == "TicketRejected", outcome
    load = LoadParams(job, 0, timeout_s=2.0, num_tokens=len(prompt)).to_kv_params()
    decoded = vllm_pair.decode.client.generate(prompt + first, 3, kv_params=load)
    assert decoded["num_cached_tokens"] == 0  # nothing was stored: the prompt was computed here
    assert len(decoded["token_ids"]) == 3


def test_a_kv_sender_whose_certificate_is_not_a_prefill_regions_is_refused(vllm_pair: VLLMPair) -> None:
    spec = ShipmentSpec(str(uuid.uuid4()), 0, "t", "float32", ((3, 4, 64),), "raw", 5.0)
    host, _, port = vllm_pair.decode.kv_endpoint.rpartition(":")
    context = client_context(vllm_pair.certs["stranger"])  # same CA, a decode region's identity
    with TcpChannel((host, int(port)), num_streams=1, ssl_context=context, unavailable_after_s=1.0) as channel:
        transfer = channel.submit(Shipment(spec))
        assert transfer.wait(8) is TransferStatus.FAILED
        assert "PEER_REFUSED" in str(transfer.error)
