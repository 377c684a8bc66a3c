"""Carrying out a placement (the Celery task's body): decide on a fresh snapshot, reserve
on the decode region, run the prefill and follow its events, record every transition.
Tokens do not pass through here: at `prefill_done` (split) or at once (local) the attempt's
hand-off is posted to Redis and the API process streams from the decode region itself.

Failures: a region that is unreachable, full or too slow costs the attempt; the next one
(attempt + 1, after backoff with jitter) excludes it, up to `max_attempts`, then FAILED
with the reason. A rerun of the task (the worker died; `acks_late`) starts a new attempt, so
the dead worker's late messages are stale and ignored.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

import grpc

from prfaas.control_plane.fleet.records import InstanceRecord, RegionNotFound
from prfaas.control_plane.jobs.errors import IllegalTransition, JobNotFound, StaleAttempt
from prfaas.control_plane.jobs.states import TERMINAL, JobState
from prfaas.control_plane.scheduling.decision import Decision, Mode, decision_dict
from prfaas.control_plane.scheduling.errors import PlacementRejected
from prfaas.control_plane.scheduling.request import Request, Slo
from prfaas.control_plane.services import Services
from prfaas.control_plane.settings import Settings
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prfaas.region.channels import ChannelCache, replies
from prfaas.transport.identity import server_name
from prfaas.transport.tickets import TicketSigner

log = logging.getLogger(__name__)
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED, grpc.StatusCode.ALREADY_EXISTS,
})  # fmt: skip


class AttemptFailed(Exception):
    """This attempt cannot finish; the instance (`region/instance` key) is left out of the next one."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(reason)
        self.where = where


class Superseded(Exception):
    """The job moved on without us (canceled, or a newer attempt)."""


class Dispatcher:
    def __init__(self, services: Services) -> None:
        self.s = services
        self.channels = ChannelCache(services.settings.tls)
        settings = services.settings
        self.signer = TicketSigner(
            {settings.ticket_key_id: settings.ticket_key.get_secret_value().encode()}, settings.ticket_key_id
        )

    def channel(self, target: str, region: str) -> grpc.Channel:
        """To an instance of `region` at `target` (with TLS, it must present that region's name)."""
        return self.channels.get(target, server_name(region))

    def run(self, job_id: str) -> str:
        """Dispatch `job_id` to the end of its prefill (or its hand-off); returns the outcome."""
        jobs = self.s.jobs
        try:
            job = jobs.get(job_id)
        except JobNotFound:
            return "gone"
        if job["state"] in TERMINAL:
            return "already " + job["state"]
        attempt = int(job["attempt"])
        try:
            if job["state"] != JobState.QUEUED or job.get("dispatched") == str(attempt):
                # a previous run of this task died mid-attempt: its attempt is abandoned
                attempt = jobs.transition(job_id, JobState.QUEUED, attempt + 1, note="dispatch restarted")
            excluded: set[str] = set()
            while True:
                jobs.update(job_id, attempt, dispatched=attempt)
                try:
                    self._attempt(job_id, job, attempt, frozenset(excluded))
                    return "dispatched"
                except AttemptFailed as exc:
                    log.warning("job %s attempt %d failed: %s", job_id, attempt, exc)
                    excluded.add(exc.where)
                    if attempt >= self.s.settings.max_attempts:
                        jobs.transition(job_id, JobState.FAILED, attempt, note=str(exc), error=str(exc))
                        return "failed"
                    time.sleep(self.s.settings.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
                    attempt = jobs.transition(job_id, JobState.QUEUED, attempt + 1, note=str(exc))
        except PlacementRejected as exc:
            reason = f"no placement: {exc}"
            try:
                jobs.transition(job_id, JobState.FAILED, attempt, note=reason, error=reason)
            except (StaleAttempt, IllegalTransition):
                return "superseded"
            return "rejected"
        except (StaleAttempt, IllegalTransition, Superseded, JobNotFound):
            return "superseded"

    def decide(self, job: dict[str, str], excluded: frozenset[str]) -> Decision:
        snapshot = self.s.regions.snapshot(self.s.model.shape, exclude=excluded)
        scheduler = self.s.schedulers[job.get("placement_asked", "auto")]
        return scheduler.decide(snapshot, job_request(job, self.s.settings))

    def _attempt(self, job_id: str, job: dict[str, str], attempt: int, excluded: frozenset[str]) -> None:
        jobs = self.s.jobs
        decision = self.decide(job, excluded)
        try:  # one instance of each region: the least loaded of those not excluded
            decode = self.s.regions.get(decision.decode_region).pick(excluded)
            prefill = self.s.regions.get(decision.prefill_region).pick(excluded)
        except RegionNotFound as exc:  # it died since the snapshot: try again without it
            raise AttemptFailed(decision.decode_region, str(exc)) from exc
        where = {f"regions_a{attempt}": f"{prefill.name}>{decode.name}"}  # metering: where each attempt ran
        if not jobs.update(job_id, attempt, **placed_fields(decision, decode, prefill), **where):
            raise Superseded(job_id)
        if decision.mode is Mode.LOCAL:
            jobs.transition(job_id, JobState.LOCAL, attempt, note=f"local in {decode.key}")
            jobs.post_ready(job_id, attempt, ready_info("local", decode))
            return
        self._split(job_id, job, attempt, decision, decode, prefill)

    def _split(
        self, job_id: str, job: dict[str, str], attempt: int, decision: Decision, decode: InstanceRecord,
        prefill: InstanceRecord,
    ) -> None:  # fmt: skip
        jobs, settings = self.s.jobs, self.s.settings
        timeout_s = settings.dispatch_timeout_s
        kv_bytes = int(job["prompt_tokens"]) * self.s.model.shape.kv_bytes_per_token
        decode_stub = decode_pb2_grpc.DecodeRegionStub(self.channel(decode.grpc_endpoint, decode.name))
        prefill_stub = prefill_pb2_grpc.PrefillRegionStub(self.channel(prefill.grpc_endpoint, prefill.name))
        try:
            reply = decode_stub.Reserve(
                decode_pb2.ReserveRequest(
                    job_id=job_id, attempt=attempt, tenant=job["tenant"], kv_bytes=kv_bytes, ttl_s=timeout_s,
                    prefill_grpc=prefill.grpc_endpoint, prefill_region=prefill.name,
                ),
                timeout=10,
            )  # fmt: skip
        except grpc.RpcError as exc:
            raise self._failed(decode.key, "reserve", exc) from exc
        jobs.transition(job_id, JobState.PREFILLING, attempt, note=f"prefill in {decision.prefill_region}")
        ticket = self.signer.issue(job_id, attempt, job["tenant"], kv_bytes, ttl_s=timeout_s)  # = the reservation
        destination = prefill_pb2.Destination(
            kv_endpoint=reply.kv_endpoint, ticket=ticket, codec=decision.codec or "", decode_region=decode.name
        )
        request = prefill_pb2.PrefillRequest(
            job_id=job_id, attempt=attempt, tenant=job["tenant"], token_ids=json.loads(job["token_ids"]),
            sampling=sampling(job), destination=destination, timeout_s=timeout_s,
        )  # fmt: skip
        try:
            for event in replies(prefill_stub.Prefill(request, timeout=timeout_s + 5)):
                kind = event.WhichOneof("event")
                if kind == "prefill_done":
                    done = event.prefill_done
                    jobs.transition(job_id, JobState.TRANSFERRING, attempt, note="prefill done, KV shipping")
                    # The decode region answers only once all KV arrived, so by the time the job
                    # can read DONE its raw bytes have been shipped: record them now, before the
                    # hand-off (the prefill region's shipment_complete event may come after DONE).
                    jobs.update(job_id, attempt, bytes_raw=kv_bytes, prefill_gpu_s=done.prefill_s)
                    kv = base64.b64encode(done.kv.SerializeToString()).decode()
                    jobs.post_ready(job_id, attempt, ready_info("split", decode, first_token=done.first_token, kv=kv))
                elif kind == "shipment_complete":
                    shipped = event.shipment_complete
                    jobs.update(job_id, attempt, bytes_raw=shipped.raw_bytes, bytes_wire=shipped.wire_bytes)
        except grpc.RpcError as exc:
            self._release(decode_stub, job_id)
            raise self._failed(prefill.key, "prefill", exc) from exc

    @staticmethod
    def _release(stub: decode_pb2_grpc.DecodeRegionStub, job_id: str) -> None:
        with contextlib.suppress(grpc.RpcError):  # else the reservation expires on its own (ttl_s)
            stub.Release(decode_pb2.ReleaseRequest(job_id=job_id), timeout=5)

    def _failed(self, where: str, step: str, exc: grpc.RpcError) -> Exception:
        # every code costs the attempt (RETRYABLE ones are the expected ones); the next tries elsewhere
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.s.regions.suspect(where)  # and no one sends it new work until it beats again
        reason = f"{step} in {where}: {exc.code().name} {exc.details() or ''}".strip()
        return AttemptFailed(where, reason)


def job_request(job: Mapping[str, str], settings: Settings) -> Request:
    """What the scheduler is asked to place for `job` (its hash in the store)."""
    return Request(
        request_id=job["id"],
        tenant=job["tenant"],
        prompt_tokens=int(job["prompt_tokens"]),
        max_new_tokens=int(job["max_new_tokens"]),
        slo=Slo(ttft_ms=settings.ttft_slo_ms, tpot_ms=settings.tpot_slo_ms),
    )


def placed_fields(decision: Decision, decode: InstanceRecord, prefill: InstanceRecord) -> dict[str, Any]:
    """The job fields that record `decision` and the instances running it (GET /v1/jobs shows them)."""
    return {
        "decision": decision_dict(decision), "placement_chosen": decision.mode.value, "decode_region": decode.name,
        "prefill_region": prefill.name, "decode_instance": decode.instance, "prefill_instance": prefill.instance,
        "decode_grpc": decode.grpc_endpoint, "prefill_grpc": prefill.grpc_endpoint,
        "cost_usd": decision.cost.total_usd, "colocated_cost_usd": decision.colocated_cost.total_usd,
    }  # fmt: skip


def ready_info(mode: str, decode: InstanceRecord, **fields: Any) -> dict[str, Any]:
    """An attempt's hand-off: where the API process streams its tokens from."""
    return {"mode": mode, "decode_grpc": decode.grpc_endpoint, "decode_region": decode.name} | fields


def sampling(job: dict[str, str]) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_new_tokens=int(job["max_new_tokens"]), temperature=float(job.get("temperature", 0) or 0), top_p=1.0
    )
    if job.get("seed"):
        msg.seed = int(job["seed"])
    return msg
