"""`VLLMDecode`: the decode backend of a region with `engine: vllm`; the KV lands in the
region's vLLM server instead of this process.

- `expect` registers the shipment with the server before the prefill starts; the KV
  endpoint is the server's KV port (the prfaas connector receives there, in the wire format
  the HF backend receives, so either engine's prefill can feed it).
- Decode sends vLLM `prompt + [first_token]` with the shipment covering the prompt
  (`LoadParams.num_tokens`): vLLM computes only the first token's position and streams the
  rest; tokens equal a single vLLM process's. A shipment that fails or misses its deadline
  is recomputed by vLLM (late, not wrong). DecodeRequest.token_ids is required.
- Generate runs the prompt whole in vLLM.
The job's sampling goes to vLLM (engine/vllm/sampling.py: what a split changes, and one
choice per job); stop strings are the agent's.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prfaas.decode_region.backend import DecodeCall, Expected, Generated, KVHold, ShipmentEvents, close_tokens
from prfaas.engine.base import ModelFacts, check_prompt
from prfaas.engine.prefix_cache import ResidencyMirror
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.engine.vllm.params import LoadParams
from prfaas.engine.vllm.remote import VLLMEngine
from prfaas.engine.vllm.sampling import check_supported, remember, salted, vllm_sampling
from prfaas.engine.vllm.server import StreamStopped
from prfaas.region.errors import Canceled, InvalidRequest
from prfaas.region.requests import MAX_TIMEOUT_S
from prfaas.transport.endpoints import hostport, parse_hostport


class ServerHold:
    """A shipment registered with the vLLM server: its connector fills paged blocks as the
    layers arrive, so there is nothing to wait for here."""

    def __init__(self, engine: VLLMEngine, expected: Expected, events: ShipmentEvents) -> None:
        self.vllm = engine
        self.expected = expected
        self.events = events
        self._ended = False
        self.cached_tokens = 0  # vLLM's own prefix cache is not pinned from here

    def start(self) -> None:
        pass

    def wait(self, deadline: float, is_active: Callable[[], bool]) -> bool:
        return not self._ended  # vLLM loads the KV or, failing that, recomputes it

    def end(self, reason: str) -> None:
        """Drop the registration in the server, whether or not a Decode claimed the reservation: a claimed
        one may never send its vLLM request (max_tokens 1, EOS or a stop as the first token, a cancel while it
        waited for a slot), and a registration no request takes stays until the server closes. Once a vLLM
        request took the KV (`KVLink.take`), forget finds nothing: a no-op."""
        self._ended = True
        with contextlib.suppress(Exception):  # the server is gone or slow: its registrations go with it
            self.vllm.forget(self.expected.job_id, self.expected.attempt)


class VLLMDecode:
    def __init__(self, engine: VLLMEngine, kv_host: str | None = None) -> None:
        """`kv_host`: the address senders dial the server's KV port at (the region's advertised
        one), when it is not the address the server listens on (a wildcard)."""
        if engine.kv_endpoint is None:
            raise ValueError("a vLLM decode region's server needs ticket keys (it receives the KV)")
        self.vllm = engine
        self.facts: ModelFacts = engine.facts
        _host, port = parse_hostport(engine.kv_endpoint)
        self.kv_endpoint: str = hostport(kv_host, port) if kv_host else engine.kv_endpoint  # [v6]:port

    def expect(self, expected: Expected, ttl_s: float, events: ShipmentEvents) -> KVHold:
        self.vllm.expect(expected.job_id, expected.attempt, ttl_s, tenant=expected.tenant, max_bytes=expected.kv_bytes)
        return ServerHold(self.vllm, expected, events)

    def check_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        check_supported(params)
        check_prompt(self.vllm.facts, token_ids, params)

    def check_decode(self, call: DecodeCall, params: SamplingParams) -> None:
        prompt = call.token_ids
        if not prompt:
            raise InvalidRequest("token_ids is empty: a vLLM decode region needs the prompt the KV belongs to")
        call.check_prompt_matches()
        self.check_prompt(prompt, params)

    @functools.cached_property
    def _tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.vllm.model_path, local_files_only=True)

    def decode_text(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def decode(self, hold: KVHold, call: DecodeCall, params: SamplingParams, deadline: float,
               canceled: threading.Event) -> list[Iterator[Chosen]]:  # fmt: skip
        assert isinstance(hold, ServerHold)  # this backend's own
        if params.max_new_tokens <= 1:  # vLLM generates at least one token: ask for none
            return [iter(())]
        remaining = deadline - time.monotonic()
        load = LoadParams(call.job_id, call.attempt, min(MAX_TIMEOUT_S, max(0.1, remaining)), len(call.token_ids))
        sampling = salted(vllm_sampling(params, "decode", call.first_token), call.cache_salt)
        prompt = [*call.token_ids, call.first_token]
        rest = self.vllm.stream(prompt, params.max_new_tokens - 1, stop=canceled, kv_params=load.to_kv_params(),
                                timeout_s=remaining, sampling=sampling)  # fmt: skip
        remembered = _remembered(rest, self.vllm.prefix_cache, prompt, call.cache_salt)
        return [_arrived_at_first(hold.events, remembered)]  # one choice (check_supported refuses n > 1)

    def generate(self, token_ids: list[int], params: SamplingParams, deadline: float,
                 canceled: threading.Event, cache_salt: str | None = None) -> Generated:  # fmt: skip
        sampling = salted(vllm_sampling(params, "generate"), cache_salt)
        remaining = deadline - time.monotonic()
        count = params.max_new_tokens
        tokens = self.vllm.stream(token_ids, count, stop=canceled, timeout_s=remaining, sampling=sampling)
        # vLLM's cache hit is not streamed back: cached_tokens stays 0 here
        return Generated([_canceled_on_stop(_remembered(tokens, self.vllm.prefix_cache, token_ids, cache_salt))])

    def close(self) -> None:
        self.vllm.close()


def _arrived_at_first(events: ShipmentEvents, tokens: Iterator[Chosen]) -> Iterator[Chosen]:
    """Once vLLM produced a token the prompt's KV is in (loaded, or recomputed): the
    prefill region owes nothing more, and losing it must not end this decode."""
    try:
        for index, token in enumerate(tokens):
            if index == 0:
                events.arrived()
            yield token
    finally:
        close_tokens(tokens)  # an early end (EOS, cancel, deadline) aborts the vLLM request


def _remembered(tokens: Iterator[Chosen], mirror: ResidencyMirror | None, prompt: list[int],
                salt: str | None) -> Iterator[Chosen]:  # fmt: skip
    """`tokens`, and once they end (or are closed), the prompt's and the output's blocks recorded in the
    region's mirror of the server's prefix cache (vLLM keeps the blocks a request filled)."""
    output: list[int] = []
    try:
        for token in tokens:
            output.append(token.token)
            yield token
    finally:
        close_tokens(tokens)
        if output:  # no token: the server refused, timed out or lost the request, and may have computed nothing
            remember(mirror, [*prompt, *output[:-1]], salt)  # the last token's KV was never computed


def _canceled_on_stop(tokens: Iterator[Chosen]) -> Iterator[Chosen]:
    try:
        yield from tokens
    except StreamStopped:
        raise Canceled("canceled during decode") from None
    finally:
        close_tokens(tokens)
