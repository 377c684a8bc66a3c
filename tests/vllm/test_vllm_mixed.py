"""Mixed engines: the HF engine prefills (as a prefill region on the embedded backend
does) and ships the KV layer by layer in the prfaas wire format; a vLLM engine decodes
from it. Same tokens as the prompt run whole in vLLM."""

from __future__ import annotations

import uuid

import pytest
import torch
from test_vllm_split import NEW_TOKENS, prompt_ids
from vllm_kit import MODEL, VLLMPair

from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.vllm.params import LoadParams
from prfaas.transport.api import Shipment, ShipmentSpec, TransferStatus
from prfaas.transport.tcp_sender import TcpChannel
from prfaas.transport.tls import client_context

pytestmark = pytest.mark.vllm


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


@pytest.fixture(scope="module")
def hf() -> HFEngine:
    return HFEngine(MODEL)


@pytest.mark.parametrize("num_tokens", [512, 1000])
def test_hf_prefill_then_vllm_decode_gives_the_same_tokens(
    vllm_pair: VLLMPair, hf: HFEngine, long_text: str, num_tokens: int
) -> None:
    prompt = prompt_ids(long_text, num_tokens)
    reference = vllm_pair.decode.client.generate(prompt, NEW_TOKENS)

    pre = hf.prefill(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    job = str(uuid.uuid4())
    ticket = vllm_pair.signer.issue(job, 0, "tenant-a", pre.kv.nbytes, ttl_s=120)
    shapes = tuple((int(layer.k.shape[0]), int(layer.k.shape[1]), int(layer.k.shape[2])) for layer in pre.kv.layers)
    spec = ShipmentSpec(job, 0, ticket, pre.kv.dtype, shapes, codec="lossless", timeout_s=60)
    host, _, port = vllm_pair.decode.kv_endpoint.rpartition(":")
    vllm_pair.decode.client.expect(job, 0, 60)
    tls = client_context(vllm_pair.certs["prefill"])  # the pair's KV links speak mutual TLS
    with TcpChannel((host, int(port)), node="hf-prefill", ssl_context=tls) as channel:
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        for index, layer in enumerate(pre.kv.layers):
            shipment.add_layer(index, _byte_view(layer.k), _byte_view(layer.v))
        assert transfer.wait(60) is TransferStatus.COMPLETED, transfer.error
    load = LoadParams(job, 0, timeout_s=60, num_tokens=num_tokens).to_kv_params()
    result = vllm_pair.decode.client.generate([*prompt, pre.first_token], NEW_TOKENS - 1, kv_params=load)

    assert result["num_cached_tokens"] == num_tokens  # decoded from HF's KV, not recomputed
    assert [pre.first_token, *result["token_ids"]] == reference["token_ids"]
