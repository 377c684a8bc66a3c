"""What the decode agent needs of an engine: the `DecodeBackend` Protocol, and what passes
between the two.

The agent (`agent.py`) owns reservations (bytes, tickets' tenant, deadlines, the watch on the
prefill region, tombstones), the worker slots and the token stream. A backend adopts the KV
a reservation receives and generates from it: `HFDecode` (`hf_backend.py`: the embedded
engine; the region's KV receiver assembles each shipment layer by layer) and `VLLMDecode`
(`vllm_backend.py`: the region's vLLM server receives the KV itself).

Lifetimes: `expect` returns a `KVHold` that lives until the agent calls `end` on it, exactly
once, when the reservation ends (whatever ends it); after `end` nothing of the shipment is
kept. The token iterators `decode` and `generate` return are closed by the agent when the
stream ends early (EOS, cancel, deadline), which aborts the engine's work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prfaas.engine.base import ModelFacts
from prfaas.engine.kv import hash_token_ids
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.region.errors import InvalidRequest


@dataclass(frozen=True)
class Expected:
    """A reservation's shipment as a backend accepts it. Units: bytes, time.monotonic()."""

    job_id: str
    attempt: int
    tenant: str  # a ticket for another tenant is refused
    kv_bytes: int  # the most raw KV bytes the shipment may carry
    deadline: float
    created: float
    # Hit-aware placement (ReserveRequest): the prompt and its prefix cache scope; a backend with a
    # prefix cache pins the prompt's leading blocks it holds, and the shipment may then carry only
    # the KV after them. None: nothing is pinned.
    cache_salt: str | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class DecodeCall:
    """A Decode request as a backend reads it."""

    job_id: str
    attempt: int
    first_token: int  # generation step 0, chosen by the prefill region
    token_ids: list[int]  # the prompt the KV belongs to (required by engines that recompute)
    num_tokens: int  # the KV's length, tokens
    token_ids_hash: str
    firsts: list[Chosen] = field(default_factory=list)  # each choice's first token (sampling.n)
    cache_salt: str | None = None  # keep the prompt's and the output's blocks under it (prefix cache)

    def check_prompt_matches(self) -> None:
        """`token_ids` is the prompt the KV was computed from, as far as the request can tell: one id per KV
        token and, where the descriptor has one, its hash. Else InvalidRequest: another prompt's ids would
        put this KV in the prefix cache under them, for other jobs to decode from."""
        if len(self.token_ids) != self.num_tokens:
            raise InvalidRequest(f"token_ids holds {len(self.token_ids)} tokens, the KV covers {self.num_tokens}")
        if self.token_ids_hash and hash_token_ids(self.token_ids) != self.token_ids_hash:
            raise InvalidRequest("token_ids do not match the KV's token_ids_hash (another prompt's cache)")


@dataclass(frozen=True)
class Generated:
    """A local run's tokens, one iterator per choice (each from step 0), and how many leading
    prompt tokens the prefix cache served (not computed)."""

    tokens: list[Iterator[Chosen]]
    cached_tokens: int = 0


class ShipmentEvents(Protocol):
    """The agent's side of a shipment, as a backend reports to it."""

    def arrived(self, trace: str = "") -> None:
        """The KV is in: the prefill region owes this reservation nothing more. `trace`: the sender's trace
        context from the shipment's OPEN (W3C traceparent; "" when it sent none)."""
        ...

    def failed(self, error: BaseException) -> None:
        """The shipment failed or does not fit: the reservation ends with `error`."""
        ...


class KVHold(Protocol):
    """A backend's hold on one reservation's shipment."""

    @property
    def cached_tokens(self) -> int:
        """Leading prompt tokens whose KV the hold pinned from the region's prefix cache: a shipment
        may carry only the KV after them (or all of it). 0: the shipment carries the whole prompt's."""
        ...

    def start(self) -> None:
        """Begin taking the shipment in (after the agent is ready for `ShipmentEvents`)."""
        ...

    def wait(self, deadline: float, is_active: Callable[[], bool]) -> bool:
        """Until the KV can be decoded from: True; False if the hold ended first (the
        reservation's error says why). DeadlineExceeded at `deadline`; Canceled once
        `is_active()` is false (the caller left)."""
        ...

    def end(self, reason: str) -> None:
        """The reservation ended: free what is held (whatever a Decode already took stays with it)."""
        ...


class DecodeBackend(Protocol):
    """An engine as the decode agent drives it; thread-safe."""

    @property
    def facts(self) -> ModelFacts: ...

    @property
    def kv_endpoint(self) -> str:
        """Where prefill regions send KV (transport/endpoints.py), returned by Reserve."""
        ...

    def expect(self, expected: Expected, ttl_s: float, events: ShipmentEvents) -> KVHold:
        """Accept `expected`'s shipment for `ttl_s` seconds; ValueError if it cannot (one is
        already expected for this job)."""
        ...

    def check_decode(self, call: DecodeCall, params: SamplingParams) -> None:
        """The engine's own checks of a Decode request (raise a RegionError or engine error)."""
        ...

    def decode(self, hold: KVHold, call: DecodeCall, params: SamplingParams, deadline: float,
               canceled: threading.Event) -> list[Iterator[Chosen]]:  # fmt: skip
        """For each choice (`call.firsts`, `params.n` of them, each with `params.for_choice`): the
        tokens of steps 1 .. max_new_tokens - 1 after its first token, decoded from the KV `hold`
        took in (after `hold.wait` returned True), with their logprobs when `params` asks; each
        ends after an end-of-sequence or stop token id (engine/hf.py `ends`)."""
        ...

    def check_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """The engine's checks of a Generate prompt (InvalidPrompt, PromptTooLong, ...)."""
        ...

    def generate(self, token_ids: list[int], params: SamplingParams, deadline: float,
                 canceled: threading.Event, cache_salt: str | None = None) -> Generated:  # fmt: skip
        """A local (end-to-end) run: one prefill, then each choice's tokens from step 0. `cache_salt`:
        the prompt's cached blocks are reused and its (and the output's) blocks kept, under that salt."""
        ...

    def decode_text(self, token_ids: list[int]) -> str:
        """The model's tokenizer: token ids -> text, special tokens skipped (stop strings)."""
        ...

    def close(self) -> None: ...


def close_tokens(tokens: Iterator[object]) -> None:
    """End a token iterator early (EOS, cancel, deadline): aborts the engine's work for it."""
    close = getattr(tokens, "close", None)
    if close is not None:
        close()
