"""The prefill region agent: the PrefillRegion gRPC service. A bounded job queue in front of
the engine workers; each admitted job is run by the region's `PrefillBackend` (prefill, and
the KV shipped to the decode region named in the request), its events streamed back to the
caller. `Reship` sends a finished job's KV again where the backend keeps it.

A job ends exactly once (`job.Job`): done, failed (transfer error, deadline) or canceled
(Cancel RPC, caller gone). Cancel stops compute at the next layer boundary and cancels the
transfer.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from prfaas.prefill_region import metrics
from prfaas.prefill_region.admission import prefill_work
from prfaas.prefill_region.backend import JobStopped, PrefillBackend
from prfaas.prefill_region.destination import Destination
from prfaas.prefill_region.events import shipment_complete, stage_spans
from prfaas.prefill_region.job import END, Job
from prfaas.prefill_region.shipping import link_report
from prfaas.protos.prfaas.v1 import prefill_pb2, prefill_pb2_grpc, registry_pb2
from prfaas.region.cancel import CancelService
from prfaas.region.errors import (
    Canceled,
    Conflict,
    DeadlineExceeded,
    Exhausted,
    Unavailable,
    streaming,
    unary,
)
from prfaas.region.requests import (
    MAX_RESHIPS,
    MAX_TIMEOUT_S,
    firsts_to_proto,
    job_uuid,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    stops,
    timeout_from,
)
from prfaas.telemetry import tracing

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 120.0
CANCELED_KEPT_S = 600.0  # a Cancel is remembered this long: a Prefill or Reship of that attempt arriving after it
MAX_CANCELED = 4096  # (the calls travel on channels of their own, in no set order) is refused
SUPERSEDE_WAIT_S = 5.0  # a newer attempt waits this long for an older one still here to stop
CLOSE_WAIT_S = 5.0  # close() waits this long for the workers to stop before it closes the backend, and again after


class PrefillAgent(CancelService, prefill_pb2_grpc.PrefillRegionServicer):
    def __init__(
        self,
        backend: PrefillBackend,
        *,
        num_workers: int = 1,
        queue_depth: int = 8,
        codec: str = "lossless",
    ) -> None:
        self.backend = backend
        self.num_workers = num_workers
        self.queue_depth = queue_depth
        self.codec = codec  # when a request names none
        self.draining = False
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="prfaas-prefill")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as a worker ends a job
        self._jobs: dict[str, Job] = {}
        self._reships: dict[str, list[_Reship]] = {}  # job -> its Reship calls in progress
        self._canceled: OrderedDict[str, tuple[int, float]] = OrderedDict()  # job -> (attempt canceled, until)
        self._busy = 0
        self._rate = 0.0  # prompt tokens/s, smoothed

    # -- admission -------------------------------------------------------------------------

    @streaming
    def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> Iterator[prefill_pb2.PrefillEvent]:
        job_id = job_uuid(request.job_id)
        timeout_s = timeout_from(request.timeout_s, default_s=DEFAULT_TIMEOUT_S, max_s=MAX_TIMEOUT_S)
        work = prefill_work(request, job_id, time.monotonic() + timeout_s, self.backend, self.codec)
        span = tracing.tracer.start_span(
            "prefill.job", context=tracing.from_metadata(context.invocation_metadata()), kind=tracing.SpanKind.SERVER,
            attributes={tracing.JOB_ID: job_id, "prfaas.attempt": request.attempt,
                        "prfaas.prompt_tokens": len(work.token_ids), "prfaas.codec": work.destination.codec},
        )  # fmt: skip
        work = dataclasses.replace(work, trace=tracing.traceparent(span))
        try:
            yield from self._prefill(job_id, Job(work, self._count_tokens), context, span)
        except BaseException as exc:
            tracing.interrupted(span, exc)
            raise
        finally:
            span.end()

    def _prefill(self, job_id: str, job: Job, context: grpc.ServicerContext,
                 span: tracing.Span) -> Iterator[prefill_pb2.PrefillEvent]:  # fmt: skip
        received = time.time_ns()
        self._supersede(job_id, job.work.attempt)
        with self._lock:
            if self.draining:
                metrics.REJECTED.labels("draining").inc()
                raise Unavailable("prefill region is draining; send the job elsewhere")
            self._check_canceled(job_id, job.work.attempt)
            if job_id in self._jobs:
                raise Conflict(f"job {job_id} is already queued or running here")
            if len(self._jobs) >= self.num_workers + self.queue_depth:
                metrics.REJECTED.labels("queue_full").inc()
                raise Exhausted(
                    f"prefill queue full: {len(self._jobs) - self._busy} queued (limit {self.queue_depth}), "
                    f"{self._busy} of {self.num_workers} workers busy"
                )
            self._jobs[job_id] = job
        ended = False
        try:
            self._gauges()
            if not context.add_callback(lambda: job.cancel(Canceled("the caller disconnected"))):
                job.cancel(Canceled("the caller disconnected"))  # the call is over already: no callback will come
            try:
                self._pool.submit(self._run, job)
            except RuntimeError:  # close() shut the pool after this job was admitted
                job.cancel(Unavailable("prefill region is stopping"))
                raise Unavailable("prefill region is stopping; send the job elsewhere") from None
            while True:
                try:
                    item = job.events.get(timeout=0.25)
                except queue.Empty:
                    # a worker enforces a running job's deadline (this is a backstop); a queued job's is enforced here
                    if time.monotonic() > job.deadline + (5.0 if job.running else 0.0):
                        job.cancel(DeadlineExceeded("prefill job deadline reached"))
                    if self._dequeued(job):  # stopped before a worker took it: its slot is free, its stream ends
                        ended = True
                        raise job.error or Canceled("stopped while queued") from None
                    continue
                if item is END:
                    ended = True
                    if job.error is not None:
                        raise job.error
                    return
                assert isinstance(item, prefill_pb2.PrefillEvent)
                stage_spans(span, item, received)
                yield item
        finally:
            if not ended:
                job.cancel(Canceled("the caller disconnected"))
                self._dequeued(job)

    def _supersede(self, job_id: str, attempt: int) -> None:
        """An older attempt of the job still here (its Cancel is winding it down, or none came): it is stopped,
        and its end waited for a moment, so the newer attempt is not refused ALREADY_EXISTS for it."""
        with self._lock:
            old = self._jobs.get(job_id)
        if old is None or old.work.attempt >= attempt:
            return
        old.cancel(Canceled(f"superseded by attempt {attempt}"))
        deadline = time.monotonic() + SUPERSEDE_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if self._jobs.get(job_id) is not old:
                    return
            time.sleep(0.02)

    def _check_canceled(self, job_id: str, attempt: int) -> None:
        """Under the lock: refuse an attempt a Cancel that came first stopped."""
        canceled = self._canceled.get(job_id)
        if canceled is not None and canceled[1] > time.monotonic() and stops(canceled[0], attempt):
            raise Canceled(f"job {job_id} attempt {attempt} was canceled before this call came")

    def _dequeued(self, job: Job) -> bool:
        """Take `job` out of the queue if it was stopped (canceled, its deadline) before a worker took it."""
        with self._lock:
            if job.error is None or job.running or self._jobs.get(job.job_id) is not job:
                return False
            del self._jobs[job.job_id]
            # its run stays queued in the pool until a worker frees (then ends at once): not with its prompt
            job.work = dataclasses.replace(job.work, token_ids=[])
        self._gauges()
        metrics.JOBS.labels(type(job.error).__name__).inc()
        return True

    # -- the job ---------------------------------------------------------------------------

    def _run(self, job: Job) -> None:
        with self._lock:
            if self._jobs.get(job.job_id) is not job:  # stopped while queued: its stream has ended
                return
            self._busy += 1
            job.running = True
        try:
            self._gauges()
            job.emit(prefill_pb2.PrefillEvent(started=prefill_pb2.Started(queued_s=time.monotonic() - job.started)))
            job.check()
            shipped = self.backend.run(job.work, job)
            job.emit(prefill_pb2.PrefillEvent(shipment_complete=shipment_complete(shipped)))
        except JobStopped:
            pass  # job.error says why
        except Exception as exc:
            job.cancel(exc)  # records the first error; stops the transfer
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()
                if self._jobs.get(job.job_id) is job:
                    del self._jobs[job.job_id]
            self._gauges()
            outcome = "done" if job.error is None else type(job.error).__name__
            metrics.JOBS.labels(outcome).inc()
            job.events.put(END)

    def _count_tokens(self, num_tokens: int, seconds: float) -> None:
        metrics.TOKENS.inc(num_tokens)
        rate = num_tokens / max(seconds, 1e-6)
        self._rate = rate if self._rate == 0 else 0.8 * self._rate + 0.2 * rate
        metrics.TOKENS_PER_S.set(self._rate)

    # -- re-shipment and cancel ------------------------------------------------------------

    @unary
    def Reship(self, request: prefill_pb2.ReshipRequest, context: grpc.ServicerContext) -> prefill_pb2.ReshipReply:
        job_id = job_uuid(request.job_id)
        timeout_s = timeout_from(request.timeout_s, default_s=DEFAULT_TIMEOUT_S, max_s=MAX_TIMEOUT_S)
        destination = Destination.parse(request.destination, self.codec)
        reship = _Reship(request.attempt)
        with self._lock:
            if self.draining:
                raise Unavailable("prefill region is draining; prefill the job again elsewhere")
            self._check_canceled(job_id, request.attempt)
            if sum(len(calls) for calls in self._reships.values()) >= MAX_RESHIPS:
                metrics.REJECTED.labels("reships_full").inc()
                raise Exhausted(f"{MAX_RESHIPS} re-shipments in progress here; prefill the job again elsewhere")
            self._reships.setdefault(job_id, []).append(reship)

        def on_cancel(stop: Callable[[], None]) -> None:  # the caller leaving, or a Cancel (`cancel`), stops it
            reship.stops.append(stop)
            if not context.add_callback(stop) or reship.error is not None:  # gone, or canceled while it started
                stop()

        try:
            reshipped = self.backend.reship(
                job_id, request.attempt, destination, time.monotonic() + timeout_s, on_cancel
            )
        except Exception:
            if reship.error is not None:  # why it was stopped (a Cancel, the region stopping), not the transfer's
                raise reship.error from None
            raise
        finally:
            with self._lock:
                calls = self._reships.get(job_id, [])
                if reship in calls:
                    calls.remove(reship)
                if not calls:
                    self._reships.pop(job_id, None)
        return prefill_pb2.ReshipReply(
            shipment=shipment_complete(reshipped.shipped),
            kv=reshipped.kv,
            first_token=reshipped.firsts[0].token,
            first_logprobs=logprobs_to_proto(reshipped.firsts[0].logprobs),
            choices=firsts_to_proto(reshipped.firsts),
            prompt_logprobs=prompt_logprobs_to_proto(reshipped.firsts[0]),
        )

    def cancel(self, job_id: str, canceled: Canceled, attempt: int = 0) -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            before = self._canceled.pop(job_id, (attempt, 0.0))[0]  # the widest Cancel is kept (0: every attempt)
            widest = 0 if 0 in (attempt, before) else max(attempt, before)
            self._canceled[job_id] = (widest, time.monotonic() + CANCELED_KEPT_S)
            while len(self._canceled) > MAX_CANCELED:
                self._canceled.popitem(last=False)
            reships = [r for r in self._reships.get(job_id, []) if stops(attempt, r.attempt)]
        if job is not None and not stops(attempt, job.work.attempt):
            job = None  # a newer attempt's prefill: this Cancel is stale
        for reship in reships:
            reship.stop(canceled)  # its transfer: the Reship call ends with it
        if job is not None:  # stopped first: a lease its forward puts after the drop below is dropped by the job
            job.cancel(canceled)
        kept = self.backend.drop(job_id, attempt)
        return job is not None or kept or bool(reships)

    # -- region ----------------------------------------------------------------------------

    def _gauges(self) -> None:
        with self._lock:
            busy, queued = self._busy, len(self._jobs) - self._busy
        metrics.BUSY_WORKERS.set(busy)
        metrics.QUEUE_DEPTH.set(queued)

    def load(self) -> dict[str, float]:
        with self._lock:
            busy, queued = self._busy, len(self._jobs) - self._busy
            tokens = {True: 0, False: 0}
            for job in self._jobs.values():
                tokens[job.running] += len(job.work.token_ids)
        return {
            "queue_depth": queued, "busy_workers": busy, "prefill_tokens_per_s": self._rate,
            "queued_prefill_tokens": tokens[False], "running_prefill_tokens": tokens[True],
        }  # fmt: skip

    def link_reports(self) -> list[registry_pb2.LinkReport]:
        """The heartbeat's measured paths (the registry's link estimates)."""
        return [link_report(region, report) for region, report in self.backend.path_reports()]

    def idle(self) -> bool:
        with self._lock:
            return not self._jobs and not self._reships

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        with self._lock:  # a Prefill or Reship admitted after this is refused; one admitted before is listed here
            self.draining = True
            jobs = list(self._jobs.values())
            reships = [r for calls in self._reships.values() for r in calls]
        for job in jobs:
            job.cancel(Unavailable("prefill region shutting down"))
        for reship in reships:
            reship.stop(Unavailable("prefill region shutting down"))
        self._pool.shutdown(wait=False, cancel_futures=True)  # the queued runs canceled: they end at once
        running = self._wait_idle(wait_s)  # a worker stuck in the backend (a stalled engine) must not hold
        self.backend.close()  # the region's stop: closing the backend ends its calls (a vLLM server is killed)
        if running and (left := self._wait_idle(wait_s)):
            log.warning("prefill region closed with workers still running jobs %s", ", ".join(left))

    def _wait_idle(self, timeout_s: float) -> list[str]:
        """The jobs a worker still runs after waiting up to `timeout_s` for them all to end."""
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0, timeout_s)
            return [job.job_id for job in self._jobs.values() if job.running]


@dataclasses.dataclass(eq=False)
class _Reship:
    """A Reship call in progress: its attempt, what stops its transfer, and why it was stopped (the first
    reason; a Cancel that comes while it starts stops the transfer as soon as it is registered)."""

    attempt: int
    stops: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    error: Exception | None = None

    def stop(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        for stop in list(self.stops):
            stop()
