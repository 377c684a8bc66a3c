"""What the prefill agent needs of an engine: the `PrefillBackend` Protocol, and what passes
between the two.

The agent (`agent.py`) owns a job's life: admission, queue, deadline, cancel, the events
its caller reads. A backend runs one admitted job: prefill the prompt and ship its KV to
the job's destination, reporting through `JobProgress`. Two implement it: `HFPrefill`
(`hf_backend.py`: the embedded engine, KV handed to the transport layer by layer) and
`VLLMPrefill` (`vllm_backend.py`: the region's vLLM server, whose connector ships).

Lifetimes: `run` returns only once the job's shipment is terminal (completed, or failed and
canceled); whatever it started (a transfer, a vLLM request) is canceled through `JobProgress`
when the job is canceled, so no shipment outlives its job.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prfaas.engine.base import ModelFacts
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.prefill_region.destination import Destination
from prfaas.protos.prfaas.v1 import common_pb2
from prfaas.transport.pathmeter import PathReport


class JobStopped(Exception):
    """Raised inside a job's work to end it early: canceled, past its deadline, or its
    shipment failed. The job's own error (set before) says why."""


@dataclass(frozen=True)
class PrefillWork:
    """One admitted job, as a backend runs it."""

    job_id: str
    attempt: int
    token_ids: list[int]
    params: SamplingParams
    destination: Destination
    deadline: float  # time.monotonic()
    ship_whole: bool  # ship after the forward instead of layer by layer (PrefillRequest.ship_whole)
    cache_salt: str | None = None  # prefix cache scope; None: the cache is neither read nor written
    ship_from_token: int = 0  # the decode region holds the KV of the tokens before this: ship the rest
    trace: str = ""  # the job's prefill span (W3C traceparent), handed to the receiver with the shipment


@dataclass(frozen=True)
class Shipped:
    """A completed shipment. Units: bytes, seconds."""

    raw_bytes: int
    wire_bytes: int
    seconds: float


@dataclass(frozen=True)
class Reshipped:
    shipped: Shipped
    kv: common_pb2.KVDescriptor
    firsts: tuple[Chosen, ...]  # each choice's first token, with its logprobs when they were asked


class JobProgress(Protocol):
    """The agent's side of a running job, as its backend reports to it."""

    @property
    def stop(self) -> threading.Event:
        """Set once the job is canceled (its error says why)."""
        ...

    def check(self) -> None:
        """Raise `JobStopped` if the job was canceled or its deadline passed."""
        ...

    def cancel(self, error: BaseException) -> None:
        """End the job with `error` (the first error wins) and cancel what is attached."""
        ...

    def attach(self, cancel: Callable[[], None]) -> None:
        """`cancel()` runs when the job is canceled; if it already was, `cancel()` runs at
        once and `JobStopped` is raised."""
        ...

    def layer_shipped(self, index: int) -> None: ...

    def prefill_done(
        self, firsts: Sequence[Chosen], kv: common_pb2.KVDescriptor, prefill_s: float, cached_tokens: int = 0
    ) -> None:
        """Prefill ended: each choice's first token (`sampling.n` of them), the KV's descriptor, and
        how many leading prompt tokens came from the prefix cache (the rest were computed)."""
        ...


class PrefillBackend(Protocol):
    """An engine as the prefill agent drives it; thread-safe (one call per worker at once)."""

    @property
    def facts(self) -> ModelFacts: ...

    def admit(self, destination: Destination, params: SamplingParams) -> Destination:
        """The engine's own checks of a request (`InvalidRequest` names the field); returns
        the destination it will ship to (a backend may pick among the endpoints)."""
        ...

    def run(self, work: PrefillWork, job: JobProgress) -> Shipped:
        """Prefill `work.token_ids` and ship the KV to `work.destination` (that of the tokens from
        `work.ship_from_token` on, or all of it: the decode region takes either); raises
        `JobStopped` (the job's error is set) or the error that ended the job."""
        ...

    def reship(self, job_id: str, attempt: int, destination: Destination, deadline: float,
               on_cancel: Callable[[Callable[[], None]], object]) -> Reshipped:  # fmt: skip
        """Ship the KV of an earlier job again, to another decode region; `NotFound` when it
        is not kept here. `on_cancel(fn)` registers what cancels the re-shipment."""
        ...

    def drop(self, job_id: str, attempt: int = 0) -> bool:
        """Forget what is kept of `job_id` for a re-shipment, if `attempt` (0: any) or a newer one made it
        (`region.requests.stops`); True if there was something."""
        ...

    def path_reports(self) -> list[tuple[str, PathReport]]:
        """What the backend's senders measured on their paths since the last call, by decode
        region (the heartbeat's link reports); empty when it ships through another stack."""
        ...

    def close(self) -> None: ...


def kv_descriptor(facts: ModelFacts, num_tokens: int, token_ids_hash: str) -> common_pb2.KVDescriptor:
    return common_pb2.KVDescriptor(
        model_fingerprint=facts.fingerprint, dtype=facts.dtype, num_tokens=num_tokens, token_ids_hash=token_ids_hash
    )
