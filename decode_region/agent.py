"""The decode region agent: KV buffer reservations with admission control, shipments
accepted only against a ticket for a reservation held here, decode streamed as tokens, and
the local (end-to-end) path for short prompts.

Lifetimes: a reservation ends exactly once (`_end`), whatever ends it (Decode finished,
Release, Cancel, client disconnect, deadline, the prefill region lost, a bad shipment); its
bytes are freed right then. Its outcome stays readable for a while (`_tombstones`), so a
caller arriving after a failure gets the failure's status, not NOT_FOUND.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, NoReturn

import grpc

from prfaas.decode_region import metrics
from prfaas.decode_region.assembly import LayoutCheck, assemble
from prfaas.decode_region.book import KVBook
from prfaas.decode_region.peer_watch import PeerWatcher, Watch
from prfaas.engine.hf import HFEngine
from prfaas.engine.kv import KVCache, LayerKV
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from prfaas.protos.rpc import (
    Canceled,
    Conflict,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    PreconditionFailed,
    RegionError,
    Unavailable,
    job_uuid,
    sampling_from_proto,
    status_of,
    streaming,
    timeout_from,
    unary,
)
from prfaas.transport.inbound import Inbound, Receiver

log = logging.getLogger(__name__)
TOMBSTONE_S = 120.0
DEFAULT_TTL_S = 60.0
DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 3600.0


@dataclass(eq=False)
class Reservation:
    job_id: str
    attempt: int
    tenant: str
    kv_bytes: int
    deadline: float  # monotonic
    created: float = field(default_factory=time.monotonic)
    layers: list[LayerKV] | None = None
    decoding: bool = False
    ended: bool = False
    error: BaseException | None = None
    canceled: threading.Event = field(default_factory=threading.Event)
    cond: threading.Condition = field(default_factory=threading.Condition)
    watch: Watch | None = None
    inbound: Inbound | None = None


class DecodeStart(NamedTuple):
    job_id: str
    params: SamplingParams
    started: float  # time.monotonic() when the call came
    deadline: float
    res: Reservation  # claimed: decoding is set


class GenerateStart(NamedTuple):
    job_id: str
    params: SamplingParams
    started: float  # time.monotonic() when the call came
    deadline: float
    token_ids: list[int]
    canceled: threading.Event  # set by Cancel or the caller going away; `_stop_local(job_id)` when done


@dataclass(frozen=True)
class Tombstone:
    attempt: int
    error: BaseException | None
    at: float


class DecodeAgent(decode_pb2_grpc.DecodeRegionServicer):
    def __init__(
        self,
        engine: HFEngine,
        receiver: Receiver | None,  # TCP (+ shared memory), or WebRTC; None: the engine receives KV itself
        *,
        kv_endpoint: str,
        kv_buffer_bytes: int,
        num_workers: int = 1,
        heartbeat_interval_s: float = 1.0,
        max_reservation_s: float = 600.0,
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.kv_endpoint = kv_endpoint
        self.book = KVBook(kv_buffer_bytes)
        self.num_workers = num_workers
        self.max_reservation_s = max_reservation_s
        self.layout = LayoutCheck(engine.dtype, engine.num_layers, engine.num_kv_heads, engine.head_dim)
        self.watcher = PeerWatcher(heartbeat_interval_s)
        self.draining = False
        self._slots = threading.BoundedSemaphore(num_workers)
        self._lock = threading.Lock()
        self._reservations: dict[str, Reservation] = {}
        self._tombstones: dict[str, Tombstone] = {}
        self._local: dict[str, threading.Event] = {}  # Generate jobs: job id -> cancel
        self._busy = 0
        self._waiting = 0
        self._rate = 0.0  # tokens/s, smoothed
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="prfaas-decode-reaper", daemon=True)
        self._reaper.start()
        self._gauges()

    # -- reservations ----------------------------------------------------------------------

    @unary
    def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext) -> decode_pb2.ReserveReply:
        job_id = job_uuid(request.job_id)
        if self.draining:
            raise Unavailable("decode region is draining; reserve elsewhere")
        if request.kv_bytes <= 0:
            raise InvalidRequest("kv_bytes must be > 0")
        ttl_s = timeout_from(request.ttl_s, default_s=DEFAULT_TTL_S, max_s=self.max_reservation_s, field="ttl_s")
        with self._lock:
            existing = self._reservations.get(job_id)
        if existing is not None:
            if existing.attempt >= request.attempt:
                raise Conflict(f"job {job_id} attempt {existing.attempt} already holds a reservation")
            self._end(existing, Canceled(f"superseded by attempt {request.attempt}"))
        res = Reservation(job_id, request.attempt, request.tenant, request.kv_bytes, time.monotonic() + ttl_s)
        with self._lock:
            if job_id in self._reservations:
                raise Conflict(f"job {job_id} already holds a reservation")
            free = self.book.reserve(job_id, request.kv_bytes)  # BufferFull -> RESOURCE_EXHAUSTED
            self._reservations[job_id] = res
            self._tombstones.pop(job_id, None)
        try:
            self._expect_shipment(res, ttl_s)
        except ValueError as exc:
            self._end(res, Conflict(str(exc)))
            raise Conflict(str(exc)) from None
        except Exception as exc:  # e.g. the engine's server is gone: the bytes go back at once
            self._end(res, exc)
            raise
        if request.prefill_grpc:
            res.watch = self.watcher.watch(request.prefill_grpc, lambda why: self._end(res, Unavailable(why)))
        self._start_assembly(res)
        self._gauges()
        return decode_pb2.ReserveReply(kv_endpoint=self.kv_endpoint, free_bytes=free, expires_in_s=ttl_s)

    def _expect_shipment(self, res: Reservation, ttl_s: float) -> None:
        """Tell the KV receiver to accept this reservation's shipment (ValueError: it cannot)."""
        assert self.receiver is not None  # the HF engine's agent
        res.inbound = self.receiver.expect(res.job_id, res.attempt, ttl_s)

    def _start_assembly(self, res: Reservation) -> None:
        """Assemble the shipment's layers as they arrive; Decode waits for `res.layers`."""
        inbound = res.inbound
        assert inbound is not None

        def run() -> None:
            try:
                layers = assemble(inbound, self.layout, res.kv_bytes, res.tenant, res.deadline)
            except BaseException as exc:
                self._end(res, exc)
                return
            if res.watch is not None:
                res.watch.stop()  # the prefill region owes us nothing more
            metrics.KV_RECEIVED.inc(sum(2 * layer.k.numel() * layer.k.element_size() for layer in layers))
            metrics.SHIPMENT_SECONDS.inc(time.monotonic() - res.created)
            with res.cond:
                if not res.ended:
                    res.layers = layers
                res.cond.notify_all()

        threading.Thread(target=run, name=f"prfaas-assemble-{res.job_id[:8]}", daemon=True).start()

    @unary
    def Release(self, request: decode_pb2.ReleaseRequest, context: grpc.ServicerContext) -> decode_pb2.ReleaseReply:
        with self._lock:
            res = self._reservations.get(job_uuid(request.job_id))
        if res is not None:
            self._end(res, Canceled("released by the caller"))
        return decode_pb2.ReleaseReply(found=res is not None)

    @unary
    def Cancel(self, request: common_pb2.CancelRequest, context: grpc.ServicerContext) -> common_pb2.CancelReply:
        job_id = job_uuid(request.job_id)
        with self._lock:
            res = self._reservations.get(job_id)
            local = self._local.get(job_id)
        if res is not None:
            self._end(res, Canceled(f"canceled: {request.reason or 'by the caller'}"))
        if local is not None:
            local.set()
        return common_pb2.CancelReply(found=res is not None or local is not None)

    def _end(self, res: Reservation, error: BaseException | None) -> None:
        """End `res` once: free its bytes, stop its shipment, its watch and its decode."""
        with res.cond:
            if res.ended:
                return
            res.ended, res.error = True, error
            res.layers = None
            res.canceled.set()
            res.cond.notify_all()
        with self._lock:
            if self._reservations.get(res.job_id) is res:
                del self._reservations[res.job_id]
                self.book.release(res.job_id)
            self._tombstones[res.job_id] = Tombstone(res.attempt, error, time.monotonic())
        if res.watch is not None:
            res.watch.stop()
        if res.inbound is not None:  # no-op once the shipment completed; else it stops and frees it
            res.inbound.cancel(f"reservation ended: {error}" if error is not None else "reservation ended")
        if error is not None:
            code, message = status_of(error)
            log.info("reservation %s attempt %d ended: %s %s", res.job_id, res.attempt, code.name, message)
        metrics.RESERVATIONS_ENDED.labels("done" if error is None else status_of(error)[0].name.lower()).inc()
        self._gauges()

    def _reap_loop(self) -> None:
        while not self._closed.wait(0.1):
            now = time.monotonic()
            with self._lock:
                due = [r for r in self._reservations.values() if now >= r.deadline and not r.decoding]
                for job_id in [j for j, t in self._tombstones.items() if now - t.at > TOMBSTONE_S]:
                    del self._tombstones[job_id]
            for res in due:
                self._end(res, DeadlineExceeded("reservation expired before its KV was decoded"))

    def _gauges(self) -> None:
        used = self.book.used_bytes
        metrics.KV_USED.set(used)
        metrics.KV_FREE.set(self.book.capacity_bytes - used)
        metrics.RESERVATIONS.set(self.book.num_reservations)

    # -- decode ----------------------------------------------------------------------------

    def _lookup(self, job_id: str, attempt: int) -> Reservation:
        with self._lock:
            res = self._reservations.get(job_id)
            tomb = self._tombstones.get(job_id)
        if res is None:
            if tomb is not None and tomb.attempt == attempt and tomb.error is not None:
                if isinstance(tomb.error, RegionError):
                    raise tomb.error
                code, message = status_of(tomb.error)
                raise _Status(code, message)
            raise NotFound(f"no reservation for job {job_id} attempt {attempt}")
        if res.attempt != attempt:
            raise PreconditionFailed(f"job {job_id} is reserved for attempt {res.attempt}, not {attempt}")
        return res

    def _begin_decode(
        self,
        request: decode_pb2.DecodeRequest,
        context: grpc.ServicerContext,
        check: Callable[[SamplingParams], None] | None = None,
    ) -> DecodeStart:
        """What every Decode does first: its deadline; the KV's model and dtype against this
        region's; `check(params)` (the engine's own request checks); then the reservation,
        claimed for this stream (an ended one raises its error, a second Decode gets
        ALREADY_EXISTS) and ended if the caller goes away."""
        started = time.monotonic()
        job_id = job_uuid(request.job_id)
        params = sampling_from_proto(request.sampling)
        deadline = started + timeout_from(request.timeout_s, default_s=DEFAULT_TIMEOUT_S, max_s=MAX_TIMEOUT_S)
        desc = request.kv
        if desc.model_fingerprint != self.engine.fingerprint or desc.dtype != self.engine.dtype:
            raise PreconditionFailed(
                f"KV of model {desc.model_fingerprint[:16]}... ({desc.dtype}) cannot be decoded by this region's "
                f"{self.engine.fingerprint[:16]}... ({self.engine.dtype})"
            )
        if check is not None:
            check(params)
        res = self._lookup(job_id, request.attempt)
        with res.cond:
            if res.ended:  # e.g. the prefill region was lost a moment ago
                self._raise_ended(res)
            if res.decoding:
                raise Conflict(f"job {job_id} is already decoding")
            res.decoding = True
        context.add_callback(lambda: self._end(res, Canceled("the caller disconnected")))
        return DecodeStart(job_id, params, started, deadline, res)

    @staticmethod
    def _raise_ended(res: Reservation) -> NoReturn:
        error = res.error or Canceled("reservation ended")
        if isinstance(error, RegionError):
            raise error
        code, message = status_of(error)
        raise _Status(code, message)

    @streaming
    def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.TokenEvent]:
        _job_id, params, started, deadline, res = self._begin_decode(request, context)
        desc = request.kv
        try:
            layers = self._wait_kv(res, deadline, context)
            if layers[0].k.shape[1] != desc.num_tokens:
                raise PreconditionFailed(f"KV covers {layers[0].k.shape[1]} tokens, the request says {desc.num_tokens}")
            kv = KVCache(
                self.engine.fingerprint, self.engine.dtype, tuple(layers), desc.num_tokens, desc.token_ids_hash
            )
            del layers
            with self._worker(deadline):
                rest = self.engine.decode(kv, request.first_token, params)
                del kv  # the decode's own cache holds it now
                yield from self._tokens(request.first_token, rest, params, res.canceled, deadline, started, "split")
        except Exception as exc:
            self._end(res, exc)
            if res.error is not exc and isinstance(res.error, RegionError):
                raise res.error from None  # e.g. Cancel won the race: CANCELLED, not a side effect
            raise
        except BaseException:  # GeneratorExit: the caller went away
            self._end(res, Canceled("the caller disconnected"))
            raise
        self._end(res, None)

    def _wait_kv(self, res: Reservation, deadline: float, context: grpc.ServicerContext) -> list[LayerKV]:
        with res.cond:
            while res.layers is None and not res.ended:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded("the KV did not arrive before the decode deadline")
                if not context.is_active():
                    raise Canceled("the caller disconnected")
                res.cond.wait(min(remaining, 0.1))
            if res.layers is not None:
                return res.layers
        self._raise_ended(res)

    def _worker(self, deadline: float) -> _WorkerSlot:
        return _WorkerSlot(self, deadline)

    def _tokens(
        self,
        first: int,
        rest: Iterator[int],
        params: SamplingParams,
        canceled: threading.Event,
        deadline: float,
        started: float,
        path: str,
    ) -> Iterator[decode_pb2.TokenEvent]:
        index, token = 0, first
        t0 = time.monotonic()
        while True:
            finish = ""
            if index == params.max_new_tokens - 1:
                finish = "length"
            elif token in self.engine.eos_token_ids and not params.ignore_eos:
                finish = "eos"
            metrics.TOKENS.labels(path).inc()
            yield decode_pb2.TokenEvent(
                index=index, token=token, last=bool(finish), finish_reason=finish,
                elapsed_s=time.monotonic() - started,
            )  # fmt: skip
            if finish:
                break
            if canceled.is_set():
                raise Canceled("canceled during decode")
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"decode deadline reached after {index + 1} tokens")
            token = next(rest)
            index += 1
        if index:
            rate = index / max(time.monotonic() - t0, 1e-6)
            self._rate = rate if self._rate == 0 else 0.8 * self._rate + 0.2 * rate
            metrics.TOKENS_PER_S.set(self._rate)

    def _begin_generate(
        self,
        request: decode_pb2.GenerateRequest,
        context: grpc.ServicerContext,
        check: Callable[[list[int], SamplingParams], None] | None = None,
    ) -> GenerateStart:
        """What every Generate does first: refuse while draining, its deadline, `check`
        (the engine's own prompt checks), then the job registered as running here."""
        started = time.monotonic()
        job_id = job_uuid(request.job_id)
        if self.draining:
            raise Unavailable("decode region is draining")
        params = sampling_from_proto(request.sampling)
        deadline = started + timeout_from(request.timeout_s, default_s=DEFAULT_TIMEOUT_S, max_s=MAX_TIMEOUT_S)
        token_ids = list(request.token_ids)
        if check is not None:
            check(token_ids, params)
        canceled = self._start_local(job_id)
        context.add_callback(canceled.set)
        return GenerateStart(job_id, params, started, deadline, token_ids, canceled)

    @streaming
    def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.TokenEvent]:
        job_id, params, started, deadline, token_ids, canceled = self._begin_generate(request, context)
        try:
            with self._worker(deadline):
                result = self.engine.prefill(token_ids, params)  # InvalidPrompt -> INVALID_ARGUMENT
                first = result.first_token
                rest = self.engine.decode(result.kv, first, params)
                del result
                yield from self._tokens(first, rest, params, canceled, deadline, started, "local")
        finally:
            self._stop_local(job_id)

    def _start_local(self, job_id: str) -> threading.Event:
        """Register a local (Generate) job; -> the event that cancels it."""
        canceled = threading.Event()
        with self._lock:
            if job_id in self._local or job_id in self._reservations:
                raise Conflict(f"job {job_id} is already running here")
            self._local[job_id] = canceled
        return canceled

    def _stop_local(self, job_id: str) -> None:
        with self._lock:
            self._local.pop(job_id, None)

    # -- region ----------------------------------------------------------------------------

    def load(self) -> dict[str, float]:
        with self._lock:
            busy, waiting = self._busy, self._waiting
        used = self.book.used_bytes
        return {
            "queue_depth": waiting, "busy_workers": busy, "kv_used_bytes": used,
            "kv_free_bytes": self.book.capacity_bytes - used, "decode_tokens_per_s": self._rate,
        }  # fmt: skip

    def idle(self) -> bool:
        with self._lock:
            return not self._reservations and not self._local and self._busy == 0

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            reservations = list(self._reservations.values())
            local = list(self._local.values())
        for res in reservations:
            self._end(res, Unavailable("decode region shutting down"))
        for event in local:
            event.set()
        self.watcher.close()


class _Status(RegionError):
    """A status carried over from a non-region error (transport, engine)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _WorkerSlot:
    """One of the agent's engine workers, waited for until `deadline`."""

    def __init__(self, agent: DecodeAgent, deadline: float) -> None:
        self.agent = agent
        self.deadline = deadline

    def __enter__(self) -> None:
        agent = self.agent
        with agent._lock:
            agent._waiting += 1
        try:
            if not agent._slots.acquire(timeout=max(0.0, self.deadline - time.monotonic())):
                raise DeadlineExceeded(f"all {agent.num_workers} decode workers stayed busy until the deadline")
        finally:
            with agent._lock:
                agent._waiting -= 1
        with agent._lock:
            agent._busy += 1
            metrics.BUSY_WORKERS.set(agent._busy)

    def __exit__(self, *exc: object) -> None:
        agent = self.agent
        with agent._lock:
            agent._busy -= 1
            metrics.BUSY_WORKERS.set(agent._busy)
        agent._slots.release()
