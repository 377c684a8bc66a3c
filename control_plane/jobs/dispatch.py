"""Carrying out a placement (the Celery task's body), without waiting on it: claim the attempt,
decide on a fresh snapshot, reserve on the decode region, start the prefill, and return. The
prefill region's event stream is read by the worker's watcher (jobs/watcher.py: one asyncio
loop per worker process), which records each transition (jobs/prefill_calls.py). Tokens do not pass through here: at
`prefill_done` (split) or at once (local) the attempt's hand-off is posted to Redis and the API
process streams from the decode region itself.

Each stage runs under a lease (jobs/leases.py) whose deadline is the scheduler's prediction for
it times `lease.factor` (at least `lease.floor_s`, at most `dispatch.timeout_s`), and the
prefill region is given the same deadline. The sweeper (jobs/sweeper.py) takes back what
overran its lease or whose worker stopped beating. A failed attempt goes to jobs/attempts.py:
the next attempt, after a backoff, leaving out the instances that failed it, up to
`max_attempts`, then FAILED with the reason. A task delivered twice (acks_late) finds its
attempt claimed and leaves it to the lease's owner or the sweeper.

Decode failover: an attempt queued with `reship_from` (the API lost its decode instance
mid-stream, jobs/generation.py) first asks the prefill region that still leases the job's KV
to ship it to a new decode instance (`Reship`); only if that fails is the prompt prefilled again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

import grpc

from prfaas.control_plane.fleet.records import InstanceRecord, RegionNotFound
from prfaas.control_plane.jobs.attempts import Attempts, Enqueue
from prfaas.control_plane.jobs.decode_calls import PREFILL_LOST
from prfaas.control_plane.jobs.errors import IllegalTransition, JobNotFound, StaleAttempt
from prfaas.control_plane.jobs.leases import Lease, Leases, process_id
from prfaas.control_plane.jobs.objectives import slo_ms
from prfaas.control_plane.jobs.placement import decode_instance
from prfaas.control_plane.jobs.prefill_calls import AttemptFailed, PrefillCalls, Started, attempt_failed
from prfaas.control_plane.jobs.prefix import cache_salt, pins, prefix_hashes
from prfaas.control_plane.jobs.records import job_request, placed_fields, ready_info, sampling
from prfaas.control_plane.jobs.states import TERMINAL, JobState
from prfaas.control_plane.jobs.watcher import Watcher
from prfaas.control_plane.scheduling.decision import Decision, Mode
from prfaas.control_plane.scheduling.errors import PlacementRejected, RejectReason
from prfaas.control_plane.scheduling.snapshot import kv_dtypes_alike
from prfaas.control_plane.services import Services
from prfaas.protos.prfaas.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2
from prfaas.region.channels import ChannelCache
from prfaas.telemetry import tracing
from prfaas.transport.identity import server_name
from prfaas.transport.tickets import TicketSigner

log = logging.getLogger(__name__)
PLACING_LEASE_S = 30.0  # claim -> prefill started: a snapshot read, a Reserve (10 s at most)
UNPLACED_RETRY_S = 1.0  # a job no region can take now is placed again this much later
NO_REGION = (RejectReason.NO_ELIGIBLE_REGION, RejectReason.UNHEALTHY)  # not busy: none alive that could serve
FULL_RETRIES = 3  # a decode instance full at Reserve is tried again this often, then left out (the attempt fails)
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED, grpc.StatusCode.ALREADY_EXISTS,
})  # fmt: skip


class PlaceAgain(Exception):
    """The placement cannot be carried out now, through no instance's fault: a region it picked left since the
    snapshot, or the decode instance has no room (RESOURCE_EXHAUSTED at Reserve: a burst of dispatches raced
    for its buffer). The same attempt is placed again shortly on a fresh snapshot, no instance left out."""


class Superseded(Exception):
    """The job moved on without us (canceled, or a newer attempt)."""


class Dispatcher:
    def __init__(self, services: Services, enqueue: Enqueue, owner: str | None = None,
                 watcher: Watcher | None = None) -> None:  # fmt: skip
        self.s = services
        settings = services.settings
        self.channels = ChannelCache(settings.tls)
        self.signer = TicketSigner(
            {settings.ticket_key_id: settings.ticket_key.get_secret_value().encode()}, settings.ticket_key_id
        )
        self.leases = Leases(services.redis, settings)
        self.owner = owner or process_id("worker")  # whose beats keep this process's leases alive
        self.attempts = Attempts(services.jobs, self.leases, enqueue, self.owner)
        self.watcher = watcher or Watcher(settings.tls)
        self.calls = PrefillCalls(services, self.leases, self.attempts, self.watcher)  # followed on the watcher

    def channel(self, target: str, region: str) -> grpc.Channel:
        """To an instance of `region` at `target` (with TLS, it must present that region's name)."""
        return self.channels.get(target, server_name(region))

    def lease(self, job_id: str, attempt: int, stage: str, where: str, seconds: float) -> Lease:
        return Lease(job_id, attempt, stage, self.owner, where, self.leases.clock.now() + seconds)

    def lease_s(self, decision: Decision) -> float:
        """A stage's lease: `lease.factor` x the scheduler's predicted TTFT (queue, prefill and
        transfer), within [lease.floor_s, dispatch.timeout_s]."""
        settings = self.s.settings
        predicted = decision.predicted_ttft_ms / 1000.0
        wanted = settings.lease.factor * predicted if predicted == predicted else settings.dispatch.timeout_s
        return min(settings.dispatch.timeout_s, max(settings.lease.floor_s, wanted))

    def run(self, job_id: str) -> str:
        """Start `job_id`'s current attempt (its prefill, or its hand-off); returns the outcome."""
        jobs = self.s.jobs
        try:
            job = jobs.get(job_id)
        except JobNotFound:
            return "gone"
        if job["state"] in TERMINAL:
            return "already " + job["state"]
        attempt = int(job["attempt"])
        claimed = self.leases.claim_dispatch(self.lease(job_id, attempt, "placing", "", PLACING_LEASE_S))
        if claimed != "ok":  # a second delivery: the attempt is in flight under its lease
            return {"gone": "gone"}.get(claimed, "in flight")
        span = tracing.tracer.start_span(
            "worker.dispatch", context=tracing.from_traceparent(job.get("trace")),
            attributes={tracing.JOB_ID: job_id, "prfaas.attempt": attempt},
        )  # fmt: skip
        with tracing.ending(span):  # failed by an error none of these expects (Redis away, a bug), raised
            try:
                self._attempt(job_id, job, attempt, span)
                return "started"
            except AttemptFailed as exc:
                tracing.failed(span, exc)
                outcome = self.attempts.fail(job_id, attempt, exc.where, str(exc))  # its lease replaces ours, then
                self.leases.take(job_id, attempt)  # ours is left only if the move was refused
                return outcome
            except PlacementRejected as exc:
                tracing.failed(span, exc)
                return self._unplaced(job_id, job, attempt, f"no placement: {exc}", exc.reason)
            except PlaceAgain as exc:
                tracing.failed(span, exc)
                return self._unplaced(job_id, job, attempt, str(exc))
            except (StaleAttempt, IllegalTransition, Superseded, JobNotFound):
                span.set_attribute("prfaas.outcome", "superseded")
                self.leases.take(job_id, attempt)
                return "superseded"

    def _unplaced(self, job_id: str, job: dict[str, str], attempt: int, reason: str,
                  why: RejectReason | None = None) -> str:  # fmt: skip
        """No region can take the job now. The fleet's view may be stale (no heartbeats while the
        registry's process restarts, every region busy): the same attempt is tried again every
        `UNPLACED_RETRY_S` until the job's deadline, then FAILED with the reason. Refused for its
        objectives (SLO), it waits no longer than its TTFT objective: past it, no placement can meet it.
        With no region of a role it needs alive at all (`NO_REGION`), no longer than `no_region_wait_s`
        from when this attempt first found none (`no_region_since`, "attempt:time", cleared by any other
        refusal): a client then hears so in seconds, not minutes, and a job that waited for a busy fleet
        still gets the whole wait if its regions then blink."""
        created = float(job.get("created_at", 0))
        deadline = created + self.s.settings.job.timeout_s
        if why == RejectReason.SLO:
            deadline = min(deadline, created + slo_ms(job, self.s.settings)[0] / 1000.0)
        seen, _, since = (job.get("no_region_since") or "").partition(":")
        if why in NO_REGION:
            if seen != str(attempt):  # the first sighting: the wait starts now
                since = str(time.time())
                self.s.jobs.update(job_id, attempt, no_region_since=f"{attempt}:{since}")
            deadline = min(deadline, float(since) + self.s.settings.dispatch.no_region_wait_s)
        elif seen:
            self.s.jobs.update(job_id, attempt, no_region_since="")  # regions again: a later loss waits anew
        if time.time() + UNPLACED_RETRY_S < deadline and self.attempts.unclaim(job_id, attempt, UNPLACED_RETRY_S):
            log.info("job %s attempt %d: %s; again in %.0f s", job_id, attempt, reason, UNPLACED_RETRY_S)
            return "unplaced"
        try:  # its lease kept until the job has ended
            self.s.jobs.transition(job_id, JobState.FAILED, attempt, note=reason, error=reason)
        except (StaleAttempt, IllegalTransition, JobNotFound):
            return "superseded"
        finally:
            self.leases.take(job_id, attempt)
        return "rejected"

    def decide(self, job: dict[str, str], excluded: frozenset[str]) -> Decision:
        snapshot = self.s.regions.snapshot(self.s.model.shape, exclude=excluded)
        scheduler = self.s.schedulers[job.get("placement_asked", "auto")]
        return scheduler.decide(snapshot, job_request(job, self.s.settings))

    def _attempt(self, job_id: str, job: dict[str, str], attempt: int, span: tracing.Span) -> None:
        jobs = self.s.jobs
        excluded = frozenset(json.loads(job.get("excluded") or "[]"))
        reship = json.loads(job.get("reship_from") or "null")
        deciding, deciding_ns = time.perf_counter(), time.time_ns()
        decision = self.decide(job, excluded)
        placement_s = time.perf_counter() - deciding
        span.set_attributes({"prfaas.placement": decision.mode.value, "prfaas.decode_region": decision.decode_region,
                             "prfaas.prefill_region": decision.prefill_region,
                             "prfaas.codec": decision.codec or ""})  # fmt: skip
        tracing.span_at("worker.placement", span, deciding_ns, time.time_ns(), {tracing.JOB_ID: job_id})
        prefix = prefix_hashes(job)
        try:  # of each region the instance holding most of the prompt, else the least loaded; decode: one with room
            decode = decode_instance(self.s.regions.get(decision.decode_region), self.s.model.shape,
                                     int(job["prompt_tokens"]), excluded, prefix)  # fmt: skip
            prefill = self.s.regions.get(decision.prefill_region).pick(excluded, prefix)
        except RegionNotFound as exc:  # it left since the snapshot (drained, aged out): the next snapshot has it not
            raise PlaceAgain(f"placement: {exc}") from exc
        if reship is not None:  # the KV is leased in the prefill region that computed it
            try:
                leased: InstanceRecord | None = self.s.regions.get(reship["region"]).instance(reship["instance"])
            except RegionNotFound:
                leased = None
            if leased is not None and kv_dtypes_alike(leased.kv_dtype, decode.kv_dtype):
                prefill = leased
            else:  # gone with its lease, or its KV is of a dtype the decode region refuses: compute it again
                reship = None
        # metering: the attempt's regions and how long its placement took
        where: dict[str, Any] = {f"regions_a{attempt}": f"{prefill.name}>{decode.name}", "placement_s": placement_s}
        if not jobs.update(job_id, attempt, **placed_fields(decision, decode, prefill), **where):
            raise Superseded(job_id)
        if decision.mode is Mode.LOCAL and reship is None:
            jobs.transition(job_id, JobState.LOCAL, attempt, note=f"local in {decode.key}")
            jobs.post_ready(job_id, attempt, ready_info("local", decode))
            self.leases.take(job_id, attempt)
            return
        self._split(job_id, job, attempt, decision, decode, prefill, span, reship=reship is not None)

    def _split(
        self, job_id: str, job: dict[str, str], attempt: int, decision: Decision, decode: InstanceRecord,
        prefill: InstanceRecord, span: tracing.Span, *, reship: bool,
    ) -> None:  # fmt: skip
        jobs = self.s.jobs
        lease_s = self.lease_s(decision)
        per_token = self.s.model.shape.kv_bytes_at(decode.kv_dtype)  # in its dtype
        kv_bytes = int(job["prompt_tokens"]) * per_token
        token_ids = json.loads(job["token_ids"])
        decode_stub = decode_pb2_grpc.DecodeRegionStub(self.channel(decode.grpc_endpoint, decode.name))
        reserve = decode_pb2.ReserveRequest(
            job_id=job_id, attempt=attempt, tenant=job["tenant"], kv_bytes=kv_bytes, ttl_s=lease_s,
            prefill_grpc=prefill.grpc_endpoint, prefill_region=prefill.name,
        )  # fmt: skip
        salt = cache_salt(job)
        if pins(job) and not reship and salt is not None:  # the decode region pins what it holds of the prompt
            reserve.cache_salt = salt
            reserve.token_ids.extend(token_ids)
        reserving = time.perf_counter()
        attributes = {tracing.JOB_ID: job_id, "prfaas.decode_region": decode.key}
        call = tracing.tracer.start_span("worker.reserve", context=tracing.set_span_in_context(span),
                                         kind=tracing.SpanKind.CLIENT, attributes=attributes)  # fmt: skip
        try:
            reply = decode_stub.Reserve(reserve, timeout=10, metadata=tracing.metadata(call))
        except grpc.RpcError as exc:
            tracing.failed(call, exc.code().name)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # its reply may be lost, not its reservation
                self._release(decode_stub, job_id, attempt)
            full = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if full and (refusals := int(job.get("full_refusals", 0) or 0) + 1) <= FULL_RETRIES:  # full for now
                jobs.update(job_id, attempt, full_refusals=refusals)  # then the attempt fails, leaving it out
                raise PlaceAgain(f"reserve in {decode.key}: RESOURCE_EXHAUSTED {exc.details() or ''}".strip()) from exc
            lost = exc.code() == PREFILL_LOST  # the decode region lost `prefill` meanwhile: that one is left out
            raise attempt_failed(self.s, prefill.key if lost else decode.key, "reserve", exc) from exc
        finally:
            call.end()
        reserve_s = time.perf_counter() - reserving
        ticket = self.signer.issue(job_id, attempt, job["tenant"], kv_bytes, ttl_s=lease_s)  # = the reservation
        destination = prefill_pb2.Destination(
            kv_endpoint=reply.kv_endpoint,
            ticket=ticket,
            codec=decision.codec or "",
            decode_region=decode.name,
            num_streams=decision.num_streams,
        )
        stage = "reship" if reship else "prefill"
        try:
            note = f"reship from {prefill.key}" if reship else f"prefill in {prefill.key}"  # region/instance
            jobs.transition(job_id, JobState.PREFILLING, attempt, note=note, reserve_s=reserve_s)
        except (StaleAttempt, IllegalTransition, JobNotFound):
            self._release(decode_stub, job_id, attempt)
            raise
        self.leases.grant(self.lease(job_id, attempt, stage, prefill.key, lease_s))
        shipped = kv_bytes - reply.cached_tokens * per_token  # the rest is held there
        started = Started(job_id, job["tenant"], attempt, shipped, decode, prefill, lease_s, span)
        if reship:
            again = prefill_pb2.ReshipRequest(job_id=job_id, attempt=attempt, destination=destination)
            again.timeout_s = lease_s
            self.calls.reship(started, again)
            return
        request = prefill_pb2.PrefillRequest(
            job_id=job_id, attempt=attempt, tenant=job["tenant"], token_ids=token_ids, sampling=sampling(job),
            destination=destination, timeout_s=lease_s, ship_from_token=reply.cached_tokens,
        )  # fmt: skip
        if salt is not None:
            request.cache_salt = salt
        self.calls.prefill(started, request)

    @staticmethod
    def _release(stub: decode_pb2_grpc.DecodeRegionStub, job_id: str, attempt: int) -> None:
        with contextlib.suppress(grpc.RpcError):  # else the reservation expires on its own (ttl_s)
            stub.Release(decode_pb2.ReleaseRequest(job_id=job_id, attempt=attempt), timeout=5)
