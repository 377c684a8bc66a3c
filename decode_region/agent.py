"""The decode region agent: the DecodeRegion gRPC service. KV buffer reservations with
admission control (`book.py`), shipments accepted only against a ticket for a reservation
held here, decode streamed as tokens, and the local (end-to-end) path for short prompts.
What runs the model is the region's `DecodeBackend` (`backend.py`); what the region holds
(reservations, their tombstones, local jobs) and how a reservation ends, `held.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Iterator
from typing import NamedTuple

import grpc

from prfaas.decode_region import metrics
from prfaas.decode_region.backend import DecodeBackend, DecodeCall, close_tokens
from prfaas.decode_region.book import KVBook
from prfaas.decode_region.held import HeldJobs, gauges
from prfaas.decode_region.local_jobs import LocalJob
from prfaas.decode_region.peer_watch import PeerWatcher, PrefillLost
from prfaas.decode_region.reservations import Reservation, ReservationEvents, raise_as_region_error
from prfaas.decode_region.tokens import TokenStream
from prfaas.decode_region.workers import WorkerSlots
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.protos.prfaas.v1 import decode_pb2, decode_pb2_grpc, registry_pb2
from prfaas.region.cancel import CancelService
from prfaas.region.channels import TlsFiles
from prfaas.region.errors import (
    Canceled,
    Conflict,
    InvalidRequest,
    NotFound,
    PreconditionFailed,
    Unavailable,
    streaming,
    unary,
)
from prfaas.region.requests import (
    MAX_TIMEOUT_S,
    firsts_from_proto,
    job_uuid,
    sampling_from_proto,
    stops,
    timeout_from,
)
from prfaas.telemetry import tracing

log = logging.getLogger(__name__)
DEFAULT_TTL_S = 60.0
DEFAULT_TIMEOUT_S = 300.0


class _Start(NamedTuple):
    params: SamplingParams
    started: float  # time.monotonic() when the call came
    deadline: float


class DecodeAgent(CancelService, decode_pb2_grpc.DecodeRegionServicer):
    def __init__(
        self,
        backend: DecodeBackend,
        *,
        kv_buffer_bytes: int,
        num_workers: int = 1,
        heartbeat_interval_s: float = 1.0,
        max_reservation_s: float = 600.0,
        max_jobs: int = 64,
        tls: TlsFiles | None = None,  # this region's: the prefill regions it watches are checked by name
    ) -> None:
        """`max_jobs`: reservations and local Generate jobs held at once; past it Reserve and Generate are
        RESOURCE_EXHAUSTED (each holds a gRPC thread while it waits: the server sizes its pool for them)."""
        self.backend = backend
        self.book = KVBook(kv_buffer_bytes)
        self.workers = WorkerSlots(num_workers)
        self.max_reservation_s = max_reservation_s
        self.held = HeldJobs(self.book, max_jobs)
        self.watcher = PeerWatcher(heartbeat_interval_s, tls)
        self.draining = False
        self._rate = metrics.Smoothed(metrics.TOKENS_PER_S)  # tokens/s
        self._prefill_rate = metrics.Smoothed(metrics.PREFILL_TOKENS_PER_S)  # of local prefills: what local costs
        self._reaper = threading.Thread(target=self._reap_loop, name="prfaas-decode-reaper", daemon=True)
        self._reaper.start()
        gauges(self.book)

    # -- reservations ----------------------------------------------------------------------

    @unary
    def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext) -> decode_pb2.ReserveReply:
        job_id = job_uuid(request.job_id)
        if self.draining:
            raise Unavailable("decode region is draining; reserve elsewhere")
        if request.kv_bytes <= 0:
            raise InvalidRequest("kv_bytes must be > 0")
        default_s = min(DEFAULT_TTL_S, self.max_reservation_s)  # for an unset ttl_s: within what this region allows
        ttl_s = timeout_from(request.ttl_s, default_s=default_s, max_s=self.max_reservation_s, field="ttl_s")
        existing = self.held.reservation(job_id)
        if existing is not None:
            if existing.attempt >= request.attempt:
                raise Conflict(f"job {job_id} attempt {existing.attempt} already holds a reservation")
            self._end(existing, Canceled(f"superseded by attempt {request.attempt}"))
        res = Reservation(job_id, request.attempt, request.tenant, request.kv_bytes, time.monotonic() + ttl_s,
                          trace=tracing.traceparent_in(context.invocation_metadata()))  # fmt: skip
        free = self.held.reserve(res)  # BufferFull -> RESOURCE_EXHAUSTED
        try:  # whatever fails from here on (the engine's server gone, a watch that cannot open) undoes it all
            salt = request.cache_salt if request.HasField("cache_salt") else None
            try:
                hold = self.backend.expect(
                    res.expected(salt, tuple(request.token_ids)), ttl_s, ReservationEvents(res, self._end)
                )
            except ValueError as exc:
                raise Conflict(str(exc)) from None
            if not res.attach(hold=hold):  # canceled, superseded or released while it was being set up
                res.raise_ended()
            if request.prefill_grpc:
                watch = self.watcher.watch(
                    request.prefill_grpc, lambda why: self._end(res, PrefillLost(why)), request.prefill_region
                )
                if not res.attach(watch=watch):
                    res.raise_ended()
            if not context.is_active():  # the caller gave up (its deadline passed): it will never use or release it
                raise Canceled("the caller left before its reservation was made")
            hold.start()  # after the watch: the shipment's arrival stops it
        except Exception as exc:
            self._end(res, exc)  # the bytes go back at once, what was attached is stopped (a no-op if it had ended)
            raise
        gauges(self.book)
        return decode_pb2.ReserveReply(
            kv_endpoint=self.backend.kv_endpoint, free_bytes=free, expires_in_s=ttl_s,
            cached_tokens=hold.cached_tokens,
        )  # fmt: skip

    @unary
    def Release(self, request: decode_pb2.ReleaseRequest, context: grpc.ServicerContext) -> decode_pb2.ReleaseReply:
        res = self.held.reservation(job_uuid(request.job_id))
        if res is not None and request.attempt and res.attempt != request.attempt:
            res = None  # another attempt's (a newer one's: this message is stale)
        if res is not None:
            self._end(res, Canceled("released by the caller"))
        return decode_pb2.ReleaseReply(found=res is not None)

    def cancel(self, job_id: str, canceled: Canceled, attempt: int = 0) -> bool:
        res, _, local = self.held.found(job_id)
        if res is not None and not stops(attempt, res.attempt):
            res = None  # a newer attempt's reservation: this Cancel is stale
        if local is not None and not stops(attempt, local.attempt):
            local = None
        if res is not None:
            self._end(res, canceled)
        if local is not None:
            local.stop(canceled)
        return res is not None or local is not None

    def _end(self, res: Reservation, error: BaseException | None) -> bool:
        return self.held.end(res, error)

    def _reap_loop(self) -> None:
        while not self.held.closed.wait(0.1):
            self.held.reap()

    # -- decode ----------------------------------------------------------------------------

    def _start(self, request: decode_pb2.DecodeRequest | decode_pb2.GenerateRequest) -> _Start:
        started = time.monotonic()
        params = sampling_from_proto(request.sampling)
        params.check_vocab(self.backend.facts.vocab_size)
        deadline = started + timeout_from(request.timeout_s, default_s=DEFAULT_TIMEOUT_S, max_s=MAX_TIMEOUT_S)
        return _Start(params, started, deadline)

    def _claim(self, call: DecodeCall, context: grpc.ServicerContext) -> Reservation:
        """The call's reservation, claimed for this stream (an ended one raises its error, a
        second Decode gets ALREADY_EXISTS) and ended if the caller goes away."""
        res, tomb, _ = self.held.found(call.job_id)
        if res is None:
            if tomb is not None and tomb.attempt == call.attempt and tomb.error is not None:
                raise_as_region_error(tomb.error)
            raise NotFound(f"no reservation for job {call.job_id} attempt {call.attempt}")
        if res.attempt != call.attempt:
            raise PreconditionFailed(f"job {call.job_id} is reserved for attempt {res.attempt}, not {call.attempt}")
        with res.cond:
            if res.ended:  # e.g. the prefill region was lost a moment ago
                res.raise_ended()
            if res.decoding:
                raise Conflict(f"job {call.job_id} is already decoding")
            res.decoding = True

        def left() -> None:
            self._end(res, Canceled("the caller disconnected"))

        if not context.add_callback(left):
            left()  # the call is over already: no callback will come
            res.raise_ended()
        return res

    @streaming
    @tracing.server_stream("decode.job")
    def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
    ) -> Generator[decode_pb2.TokenEvent, None, None]:
        desc = request.kv
        first_logprobs = request.first_logprobs if request.HasField("first_logprobs") else None
        firsts = firsts_from_proto(request.first_token, first_logprobs, request.choices, request.prompt_logprobs)
        call = DecodeCall(job_uuid(request.job_id), request.attempt, request.first_token, list(request.token_ids),
                          desc.num_tokens, desc.token_ids_hash, firsts,
                          request.cache_salt if request.HasField("cache_salt") else None)  # fmt: skip
        params, started, deadline = self._start(request)
        if len(firsts) != params.n:
            raise InvalidRequest(f"{len(firsts)} first tokens for sampling.n={params.n} choices")
        facts = self.backend.facts
        if desc.model_fingerprint != facts.fingerprint or desc.dtype != facts.dtype:
            raise PreconditionFailed(
                f"KV of model {desc.model_fingerprint[:16]}... ({desc.dtype}) cannot be decoded by this region's "
                f"{facts.fingerprint[:16]}... ({facts.dtype})"
            )
        self.backend.check_decode(call, params)
        res = self._claim(call, context)
        rests: list[Iterator[Chosen]] = []
        try:
            if res.hold is None:  # Reserve has not returned yet
                raise PreconditionFailed(f"job {call.job_id}'s reservation is not set up yet; Decode after Reserve")
            if not res.hold.wait(deadline, context.is_active):
                res.raise_ended()
            with self.workers.slot(deadline, res.canceled):
                rests = self.backend.decode(res.hold, call, params, deadline, res.canceled)
                yield from self._tokens(firsts, rests, params, res.canceled, deadline, started, "split")
        except Exception as exc:
            if not self._end(res, exc) and res.error is not None:
                raise_as_region_error(res.error)  # e.g. Cancel won the race: CANCELLED, not a side effect
            raise
        except BaseException:  # GeneratorExit: the caller went away
            self._end(res, Canceled("the caller disconnected"))
            raise
        finally:
            for rest in rests:
                close_tokens(rest)
        self._end(res, None)

    def _tokens(
        self, firsts: list[Chosen] | None, rests: list[Iterator[Chosen]], params: SamplingParams,
        canceled: threading.Event, deadline: float, started: float, path: str, cached_tokens: int = 0,
    ) -> Generator[decode_pb2.TokenEvent, None, None]:  # fmt: skip
        stream = TokenStream(self.backend.facts, self.backend.decode_text, path)
        yield from stream.events(firsts, rests, params, canceled, deadline, started, cached_tokens)
        if stream.rate is not None:
            self._rate.add(stream.rate)

    @streaming
    @tracing.server_stream("decode.generate")
    def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Generator[decode_pb2.TokenEvent, None, None]:
        job_id = job_uuid(request.job_id)
        if self.draining:
            raise Unavailable("decode region is draining")
        params, started, deadline = self._start(request)
        token_ids = list(request.token_ids)
        self.backend.check_prompt(token_ids, params)
        job = LocalJob(request.attempt)
        canceled = job.canceled
        self.held.add_local(job_id, job)
        if not context.add_callback(job.stop):
            job.stop()  # the call is over already: no callback will come
        rests: list[Iterator[Chosen]] = []
        try:
            with self.workers.slot(deadline, canceled):
                salt = request.cache_salt if request.HasField("cache_salt") else None
                begun = time.monotonic()
                generated = self.backend.generate(token_ids, params, deadline, canceled, salt)
                rests = generated.tokens
                events = self._tokens(None, rests, params, canceled, deadline, started, "local",
                                      generated.cached_tokens)  # fmt: skip
                try:
                    for i, event in enumerate(events):
                        if i == 0:  # the first token ends the prefill (one decode step beside it)
                            self._count_prefill(len(token_ids) - generated.cached_tokens, time.monotonic() - begun)
                        yield event
                finally:
                    events.close()  # as `yield from` would: the caller's cancel reaches the stream now
        except Exception:
            if job.reason is not None:  # a Cancel or the region shutting down: its status, not the stop's side effect
                raise_as_region_error(job.reason)
            raise
        finally:
            for rest in rests:
                close_tokens(rest)
            self.held.drop_local(job_id)

    def _count_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:  # else all of it was cached: nothing measured
            self._prefill_rate.add(num_tokens / max(seconds, 1e-6))

    # -- region ----------------------------------------------------------------------------

    def link_reports(self) -> list[registry_pb2.LinkReport]:
        return []  # a decode region receives KV; the senders measure the paths

    def load(self) -> dict[str, float]:
        used = self.book.used_bytes
        return {
            "queue_depth": self.workers.waiting, "busy_workers": self.workers.busy, "kv_used_bytes": used,
            "kv_free_bytes": self.book.capacity_bytes - used, "decode_tokens_per_s": self._rate.value,
            "prefill_tokens_per_s": self._prefill_rate.value,
            "decode_running": self.workers.busy, "decode_slots": self.workers.num_workers,
            "mean_job_s": self.workers.mean_hold_s,
        }  # fmt: skip

    def idle(self) -> bool:
        return self.held.empty() and self.workers.busy == 0

    def close(self, wait_s: float = 5.0) -> None:
        reservations, local = self.held.close()
        ending = threading.Thread(target=self.held.end_all, args=(reservations, local), daemon=True)
        ending.start()  # waited for `wait_s` (s), not for ever: ending a hold can wait on a stalled engine (vLLM's
        ending.join(wait_s)  # forget); closing the backend ends the engine's calls (kills a vLLM server), and so them
        self.watcher.close()
        self.backend.close()
