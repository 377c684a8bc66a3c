"""API side of a job: wait for the dispatcher's hand-off of the current attempt, stream the
tokens from the decode region (gRPC), record DECODING and DONE (billed once by the store).

A decode stream that breaks (its instance died, or its region) costs the attempt: the next
one is queued (jobs/attempts.py) leaving that instance out and, for a split job, naming the
prefill instance that still leases its KV (`reship_from`: the dispatcher reships it rather
than prefill again). The next attempt's stream is picked up and the tokens already sent are
skipped, so the client's stream goes on without repeating or skipping a token (greedy
decoding, or the seeded sampler every job gets, gives the same tokens again). A Decode that
ends `PREFILL_LOST` (the decode region lost the prefill instance that owed it the KV:
jobs/decode_calls.py) leaves that prefill instance out instead, and reships nothing from it.

While it streams a job, this process is its follower (`JobStore.follow`); the sweeper ends
the jobs of a follower that stopped beating (jobs/sweeper.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import grpc
import redis

from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.usage import served_timing
from prfaas.control_plane.jobs.attached import AttachedReader
from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.celery_app import enqueue
from prfaas.control_plane.jobs.decode_calls import (
    PREFILL_LOST,
    cancel_in_regions,
    region_channels,
    released,
    start_decode,
    trace_parent,
)
from prfaas.control_plane.jobs.errors import (
    RECORD_LOST,
    STORE_LOST,
    IllegalTransition,
    JobEnded,
    JobNotFound,
    StaleAttempt,
)
from prfaas.control_plane.jobs.leases import Leases
from prfaas.control_plane.jobs.placement import AdmissionPlacer
from prfaas.control_plane.jobs.records import job_sampling
from prfaas.control_plane.jobs.states import TERMINAL, JobState
from prfaas.control_plane.jobs.store import CLIENT_LEFT, SHUTTING_DOWN
from prfaas.control_plane.jobs.tokenlog import Outputs, Token, TokenLog
from prfaas.control_plane.services import Services
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2_grpc
from prfaas.region.requests import logprobs_from_proto
from prfaas.telemetry import tracing
from prfaas.transport.identity import server_name

log = logging.getLogger(__name__)
CONFLICT_RETRIES = 3  # calls again when the decode region still runs the job for a caller that is gone
CONFLICT_PAUSE_S = 0.5


class Follower:
    def __init__(self, services: Services, celery: Any, meter: Meter | None = None, owner: str = "") -> None:
        self.s = services
        self.celery = celery
        self.owner = owner  # this API process, as it beats (jobs/leases.py); "" follows nothing

        def enqueue_job(job_id: str, countdown_s: float) -> object:
            return enqueue(celery, job_id, countdown_s)

        self.leases = Leases(services.redis, services.settings)
        self.attempts = Attempts(services.jobs, self.leases, enqueue_job, owner)
        self.log = TokenLog(services.jobs)
        self.channels = region_channels(services.settings.tls)  # keepalive: a hung region breaks its stream in seconds
        self._decode_stubs: dict[tuple[str, str], decode_pb2_grpc.DecodeRegionStub] = {}  # by target and region
        self.placer = AdmissionPlacer(services, services.settings.snapshot_ttl_s)
        self.meter = meter  # bills each job once it is DONE (off this thread)
        self._streamed: dict[str, Outputs] = {}  # the jobs this process streams now: what a cancel here records
        self._calls: dict[str, Any] = {}  # their decode calls in flight (gRPC streams), which `end_all` cancels
        self.ending = threading.Event()  # this process shuts down (`end_all`): no job streams or is read here now

    def tokens(
        self, job_id: str, job: dict[str, str] | None = None, ready: dict[str, Any] | None = None, *,
        after_attempt: int = 0, already: list[Token] | None = None, parent: tracing.Span | None = None,
        followed: bool = False,
    ) -> Iterator[Token]:  # fmt: skip
        """The job's tokens, from whichever attempt delivers them. `ready` (with `job`, its
        record) is a hand-off the caller already holds: the first attempt starts from it.
        Adopting a job another process followed: `after_attempt`, the last attempt whose
        hand-off is stale; `already`, the tokens it logged (skipped, not logged again).
        `parent`: the job's span (else the trace its record names), parent of each decode call's.
        `followed`: this process follows the job already (`JobStore.create(follow_as=...)`)."""
        try:
            if self.owner and not followed:
                self.leases.follow(job_id, self.owner)
            unfollowed = False
            outputs = self._streamed[job_id] = Outputs(already or ())
            try:
                if self.ending.is_set():  # admitted as this process shut down, after `end_all`: it ends too, now
                    self.cancel(job_id, SHUTTING_DOWN, wait=False)  # (a decode call would race the regions' Cancel)
                    raise JobEnded("CANCELED", f"canceled: {SHUTTING_DOWN}")
                unfollowed = yield from self._tokens(job_id, job, ready, after_attempt, outputs, parent)
            except BaseException:  # its client gone (GeneratorExit), the job canceled, failed or timed out
                self._cut(job_id, outputs)
                raise
            finally:
                if self._streamed.get(job_id) is outputs:
                    del self._streamed[job_id]
                if self.owner and not unfollowed:
                    with contextlib.suppress(redis.RedisError):  # an outage's other errors say it already
                        self.leases.unfollow(job_id, self.owner)
        except redis.RedisError as exc:  # its decode call ends with this generator (the stream is dropped)
            self.abandon(job_id, f"job store unreachable mid-job ({type(exc).__name__})")
            raise JobEnded("FAILED", STORE_LOST) from None
        except JobNotFound:  # Redis came back empty under it: the record is gone, and with it the job
            raise JobEnded("FAILED", RECORD_LOST) from None

    def abandon(self, job_id: str, reason: str) -> None:
        """FAILED with `reason`, for a job this process can no longer follow (Redis unreachable): tried on a
        thread of its own every second until Redis answers (or the job's deadline), so that a Redis that comes
        back with its data does not keep the job running for nobody; a Redis that comes back empty lost it."""
        deadline = time.monotonic() + self.s.settings.job.timeout_s

        def fail() -> None:
            while time.monotonic() < deadline:
                try:
                    job = self.s.jobs.get(job_id)
                    if job["state"] in TERMINAL:
                        return
                    self.s.jobs.transition(job_id, JobState.FAILED, int(job["attempt"]), note=reason, error=reason,
                                           unfollow=self.owner)  # fmt: skip
                    return
                except StaleAttempt:
                    continue  # a new attempt began meanwhile: fail that one
                except (IllegalTransition, JobNotFound):
                    return
                except redis.RedisError:
                    time.sleep(1.0)

        threading.Thread(target=fail, name=f"abandon-{job_id[:8]}", daemon=True).start()

    def _tokens(self, job_id: str, job: dict[str, str] | None, ready: dict[str, Any] | None, after: int,
                output: Outputs, parent: tracing.Span | None) -> Generator[Token, None, bool]:  # fmt: skip
        """The tokens; returns True when the DONE move also ended this process's follow of the job."""
        jobs = self.s.jobs
        deadline = time.monotonic() + self.s.settings.job.timeout_s
        info = ready
        conflicts = 0
        while True:
            if info is None:
                info = jobs.wait_ready(job_id, after, max(0.0, deadline - time.monotonic()))
                job = None
                if info is not None and self.owner and self.leases.follower_of(job_id) != self.owner:
                    # another process follows the job now (this one paused past `dead_after_s`, and a worker adopted
                    # it): its tokens come from that one's log, not from a decode call of this one's beside it
                    yield from self._adopted_elsewhere(job_id, output)
                    return True
            if info is None:
                job = jobs.get(job_id)
                if job["state"] in (JobState.FAILED, JobState.CANCELED):
                    raise JobEnded(job["state"], job.get("error") or job["state"].lower())
                if job["state"] == JobState.DONE:
                    raise JobEnded("DONE", "finished elsewhere")
                self.cancel(job_id, "deadline", wait=False)  # the client hears now, whatever the regions do
                raise JobEnded("TIMEOUT", f"no result within {self.s.settings.job.timeout_s:g} s")
            attempt = int(info["attempt"])
            after = attempt
            if job is None:
                job = jobs.get(job_id)
            handed, info = info, None
            stub = self._decode_stub(handed["decode_grpc"], handed.get("decode_region", ""))
            remaining = max(1.0, deadline - time.monotonic())
            call = tracing.tracer.start_span(
                "api.decode", context=trace_parent(parent, job), kind=tracing.SpanKind.CLIENT,
                attributes={tracing.JOB_ID: job_id, "prfaas.attempt": attempt, "prfaas.placement": handed["mode"],
                            "prfaas.decode_region": handed.get("decode_region", "")},
            )  # fmt: skip
            try:
                stream = self._calls[job_id] = start_decode(stub, job_id, job, handed, attempt, remaining,
                                                             tracing.metadata(call))  # fmt: skip
                first: tuple[float, float] | None = None  # token 0: (wall time, stream elapsed s)
                served: dict[str, int] = {}  # a local run's prefix cache hit, recorded with DONE
                n = job_sampling(job).n  # choices: DONE once each ended
                with released(stream) as finished:
                    for event in stream:
                        if event.index == 0 and event.choice == 0:
                            first = (time.time(), event.elapsed_s)
                            if handed["mode"] == "local":
                                served = {"cached_tokens": event.cached_tokens}
                            if handed["mode"] == "split":
                                tenant = job["tenant"]
                                jobs.transition(job_id, JobState.DECODING, attempt, note="first token", tenant=tenant)
                        # the stream's timing (a stall of its region not counted): what DONE or a cut is billed
                        timing = (
                            output.timed(attempt, first, event.elapsed_s, event.choice) if first is not None else None
                        )
                        token = Token(
                            event.index, event.token, event.last, event.finish_reason, event.stop_reason,
                            logprobs_from_proto(event.logprobs) if event.HasField("logprobs") else None, event.choice,
                            tuple(logprobs_from_proto(p) for p in event.prompt_logprobs),
                        )  # fmt: skip
                        if not output.add(token):
                            continue  # sent before this attempt
                        done = output.done(n)
                        if not done:
                            self.log.log_token(job_id, token)
                        else:  # the last token logged with DONE, in the same step; billed from the ledger
                            try:
                                jobs.transition(
                                    job_id, JobState.DONE, attempt, note=event.finish_reason, tenant=job["tenant"],
                                    log_token=token.entry(), unfollow=self.owner,
                                    **(output.record() | served_timing(timing, event.elapsed_s) | served),
                                )  # fmt: skip
                            except (StaleAttempt, IllegalTransition):
                                output.undo(token)  # not sent: the newer attempt's stream brings it, and ends the job
                                raise
                            if self.meter is not None:
                                self.meter.job_done(job_id)
                            finished.set()
                        yield token
                        if done:
                            return bool(self.owner)
            except grpc.RpcError as exc:
                tracing.failed(call, exc.code().name)
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS and conflicts < CONFLICT_RETRIES:
                    # the decode region still runs this job for a caller that is gone (a dead API
                    # process, whose call it has not noticed ending yet): end that one, call again
                    conflicts += 1
                    self._cancel_decode(job_id, handed, "superseded by a newer call")
                    time.sleep(CONFLICT_PAUSE_S)
                    info = handed
                    continue
                self._lost(job_id, attempt, handed["mode"], exc, after_tokens=output.count)
            except (StaleAttempt, IllegalTransition):
                continue  # a newer attempt (or a cancel) took over
            except BaseException as exc:  # Redis away, JobEnded, a bug: failed; its reader gone (GeneratorExit): not
                tracing.interrupted(call, exc)
                raise
            finally:
                self._calls.pop(job_id, None)
                tracing.end(call)  # once: a second end is a no-op

    def _adopted_elsewhere(self, job_id: str, output: Outputs) -> Iterator[Token]:
        """The tokens of a job this process followed and another adopted, those not sent yet, from its log."""
        log.warning("job %s is followed by %s now: its tokens are read from its log", job_id,
                    self.leases.follower_of(job_id))  # fmt: skip
        n = job_sampling(self.s.jobs.get(job_id)).n
        reader = self.attached(job_id)
        try:
            for token in reader:
                if output.add(token):
                    yield token
                    if output.done(n):
                        return
        finally:
            reader.close()

    def attached(self, job_id: str) -> AttachedReader:
        """The tokens of a job another request follows (an Idempotency-Key retry while it runs), from its token
        log: the same tokens, without a decode of its own, billed once. Counted as a reader from now on."""
        return AttachedReader(self.s.jobs, self.log, self.s.settings, job_id, self.owner, self.ending)

    def disconnected(self, job_id: str, stream: Iterator[Token]) -> None:
        """The client of the job's own stream (`tokens`) went away mid-stream: the job is
        canceled in both regions, unless requests are attached to it, for which `stream` is
        read on a thread of its own, to its end or until none of them counts any more (their
        process died: jobs/tokenlog.py), when the job is canceled after all."""
        close = getattr(stream, "close", None)
        if self.left(job_id):
            if close is not None:
                close()  # its end: no longer this process's to follow
            return

        def drain() -> None:
            checked = time.monotonic()
            try:
                for _ in stream:
                    if time.monotonic() - checked >= self.s.settings.beat_s:
                        checked = time.monotonic()
                        with contextlib.suppress(redis.RedisError):  # the stream itself says when Redis is away
                            if self.left(job_id):  # no attached reader counts now (their process died): canceled
                                break
            except JobEnded as exc:
                log.info("job %s, followed for attached requests only, ended: %s", job_id, exc)
            finally:
                if close is not None:
                    close()

        threading.Thread(target=drain, name=f"drain-{job_id[:8]}", daemon=True).start()

    def left(self, job_id: str) -> bool:
        """The client of the job's own request went away: the job is canceled in both regions (True), unless
        requests are attached to it, for which it runs on (its reader then reads it to its end for them)."""
        if self.log.readers(job_id) > 0:
            return False
        self.cancel(job_id, CLIENT_LEFT, by_client=True)
        return True

    def _cancel_decode(self, job_id: str, handed: dict[str, Any], reason: str) -> None:
        stub = self._decode_stub(handed["decode_grpc"], handed.get("decode_region", ""))
        try:
            request = common_pb2.CancelRequest(job_id=job_id, reason=reason, attempt=int(handed["attempt"]))
            stub.Cancel(request, timeout=2)
        except grpc.RpcError as exc:
            log.warning("cancel of %s's older call in %s: %s", job_id, handed["decode_grpc"], exc.code().name)

    def _decode_stub(self, target: str, region: str) -> decode_pb2_grpc.DecodeRegionStub:
        stub = self._decode_stubs.get((target, region))
        if stub is None:
            channel = self.channels.get(target, server_name(region))
            stub = self._decode_stubs[(target, region)] = decode_pb2_grpc.DecodeRegionStub(channel)
        return stub

    def _lost(self, job_id: str, attempt: int, mode: str, exc: grpc.RpcError, after_tokens: int) -> None:
        """The decode stream of `attempt` broke: queue the next attempt (decode failover)."""
        try:
            job = self.s.jobs.get(job_id)
        except JobNotFound:
            return
        if int(job.get("attempt", 0)) != attempt:
            return  # a newer attempt (or the sweeper) already took over
        where = f"{job['decode_region']}/{job['decode_instance']}" if job.get("decode_instance") else ""
        log.warning("job %s attempt %d: decode stream in %s ended after %d tokens: %s", job_id, attempt,
                    where or "?", after_tokens, exc.code().name)  # fmt: skip
        reason = f"{mode} decode in {where or '?'} lost after {after_tokens} tokens: {exc.code().name}"
        if mode == "split" and exc.code() == PREFILL_LOST:  # the decode instance is fine, its KV's source is not:
            # that one is left out (it may hang: no reship from it), and the next attempt computes the prompt again
            prefill = f"{job['prefill_region']}/{job['prefill_instance']}" if job.get("prefill_instance") else ""
            self.attempts.fail(job_id, attempt, prefill, f"{reason} ({exc.details()})", reship_from="")
            return
        if exc.code() == grpc.StatusCode.UNAVAILABLE and where:
            self.s.regions.suspect(where)
        if exc.code() == grpc.StatusCode.CANCELLED:  # someone canceled the call there (a sweeper, a newer call):
            where = ""  # no fault of the instance, which the next attempt may use
        reship: dict[str, str] | str = ""
        if mode == "split" and job.get("prefill_instance"):  # its KV is still leased there a while
            reship = {"region": job["prefill_region"], "instance": job["prefill_instance"]}
        self.attempts.fail(job_id, attempt, where, reason, reship_from=reship)

    def cancel(self, job_id: str, reason: str, *, wait: bool = True, by_client: bool = False) -> bool:
        """CANCELED in the store, then Cancel in both regions (idempotent there); `wait`: for their answers.
        `by_client`: the tenant's choice (its client left, or it canceled the job), not the platform's: the
        tokens its follower got are billed (billing/usage.py), as vLLM-backed APIs bill an aborted request's
        output so far; recorded with the move where this process streams the job, else by its follower when its
        stream ends (`_cut`)."""
        if self.ending.is_set() and not by_client:  # this process shuts down: a batch's other prompts, a deadline
            reason = SHUTTING_DOWN
        marked: dict[str, Any] = {"client_left": 1} if reason == SHUTTING_DOWN else {}  # its retry: a fresh job
        if by_client:  # streamed here: what it got as of now, with the move (a token that comes later is not billed)
            streamed = self._streamed.get(job_id)
            cut = streamed.cut() if streamed is not None else {}
            closed = {"cut_closed": 1} if streamed is not None else {}  # no later record (`_cut`) replaces this one
            marked = {"client_canceled": 1, "client_left": int(reason == CLIENT_LEFT), "canceled_at": time.time()}
            marked |= cut | closed
        try:
            # followed from its creation: a job canceled before its stream was read is no longer ours either
            self.s.jobs.transition(job_id, JobState.CANCELED, 0, note=reason, error=f"canceled: {reason}",
                                   unfollow=self.owner, **marked)  # fmt: skip
        except (IllegalTransition, JobNotFound):
            return False
        if by_client and self.meter is not None:  # billed once its follower has recorded what it got (`_cut`)
            self.meter.job_done(job_id)
        cancel_in_regions(self.channels, job_id, self.s.jobs.get(job_id), reason, wait)
        return True

    def streaming(self) -> int:
        """How many jobs this process streams now."""
        return len(self._streamed)

    def end_all(self, reason: str = SHUTTING_DOWN) -> int:
        """This process shuts down (api/shutdown.py): each job it streams is canceled (its regions told, not waited
        for; its decode call, which may have outrun that Cancel, cancelled), its client gets the cancel as its
        stream's end, and requests attached here to another process's job end at their next look (`ending`)."""
        self.ending.set()  # from now on every cancel here is SHUTTING_DOWN's (a batch's other prompts too)
        ended = 0
        for job_id in list(self._streamed):
            with contextlib.suppress(redis.RedisError):  # that stream ends with the outage (`abandon`)
                ended += self.cancel(job_id, reason, wait=False)
            if (call := self._calls.get(job_id)) is not None:
                call.cancel()
        return ended

    def _cut(self, job_id: str, output: Outputs) -> None:
        """The job's stream ended before DONE with tokens read: what it got, for the bill of a job its client
        canceled (`cancel(by_client=True)`), recorded while its attempt is current; then billed if it is one
        (the biller skips any other). Whichever of this and the cancel comes second finds both in the record:
        each queues the job after its own write."""
        cut = output.cut()
        if not cut or output.timing is None:
            return
        with contextlib.suppress(redis.RedisError):  # an outage: the job is not billed (the platform's loss)
            # refused once the sweep took the job for platform waste (billing/reconcile.py, `cut_closed`)
            if self.s.jobs.update(job_id, output.timing.attempt, unless="cut_closed", **cut) and self.meter is not None:
                self.meter.job_done(job_id)
