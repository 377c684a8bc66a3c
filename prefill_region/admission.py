"""A Prefill call checked and turned into the work its region runs (prefill_region/agent.py)."""

from __future__ import annotations

from prfaas.prefill_region.backend import PrefillBackend, PrefillWork
from prfaas.prefill_region.destination import Destination
from prfaas.protos.prfaas.v1 import prefill_pb2
from prfaas.region.errors import InvalidRequest
from prfaas.region.requests import sampling_from_proto


def prefill_work(request: prefill_pb2.PrefillRequest, job_id: str, deadline: float, backend: PrefillBackend,
                 codec: str) -> PrefillWork:  # fmt: skip
    """A Prefill call's work, checked against the model (InvalidRequest: an empty prompt, a token outside the
    vocabulary, a prompt and its new tokens past the context, nothing left to ship) and admitted by the backend
    (its destination; `codec` where the request names none)."""
    token_ids = list(request.token_ids)
    params = sampling_from_proto(request.sampling)
    facts = backend.facts
    params.check_vocab(facts.vocab_size)
    if not token_ids:
        raise InvalidRequest("token_ids is empty; at least one token is required")
    bad = next((t for t in token_ids if t >= facts.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {facts.vocab_size})")
    if len(token_ids) + params.max_new_tokens > facts.max_context:
        raise InvalidRequest(
            f"prompt of {len(token_ids)} tokens plus max_new_tokens {params.max_new_tokens} exceeds "
            f"the model's context of {facts.max_context} tokens"
        )
    if request.ship_from_token >= len(token_ids):
        raise InvalidRequest(f"ship_from_token {request.ship_from_token} leaves none of the {len(token_ids)} tokens")
    destination = backend.admit(Destination.parse(request.destination, codec), params)
    salt = request.cache_salt if request.HasField("cache_salt") else None
    return PrefillWork(job_id, request.attempt, token_ids, params, destination, deadline, request.ship_whole,
                       salt, request.ship_from_token)  # fmt: skip
