"""API side of a job: wait for the dispatcher's hand-off of the current attempt, stream the
tokens from the decode region (gRPC), record DECODING and DONE (billed once by the store).
A failed attempt's stream is dropped and the next attempt's picked up; tokens already sent
are skipped (greedy decoding, or a seeded sampler, gives the same tokens again)."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.experimental

from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.usage import served_timing
from prfaas.control_plane.jobs.celery_app import enqueue
from prfaas.control_plane.jobs.dispatch import sampling
from prfaas.control_plane.jobs.errors import IllegalTransition, JobNotFound, StaleAttempt
from prfaas.control_plane.jobs.placement import AdmissionPlacer
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from prfaas.region.channels import ChannelCache
from prfaas.transport.identity import server_name

log = logging.getLogger(__name__)


class JobEnded(Exception):
    """The job ended without its tokens: `state` FAILED, CANCELED, or TIMEOUT (our deadline)."""

    def __init__(self, state: str, reason: str) -> None:
        super().__init__(reason)
        self.state = state


@dataclass(frozen=True)
class Token:
    index: int
    token: int
    last: bool
    finish_reason: str


class Follower:
    def __init__(self, services: Services, celery: object, meter: Meter | None = None) -> None:
        self.s = services
        self.celery = celery
        # A token stream is read on the thread that asked for it: without this option every stream call
        # on an idle channel starts a thread of its own to pump the channel's events (~0.2 ms a request).
        self.channels = ChannelCache(
            services.settings.tls, ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)
        )
        self._decode_stubs: dict[tuple[str, str], decode_pb2_grpc.DecodeRegionStub] = {}  # by target and region
        self.placer = AdmissionPlacer(services, services.settings.snapshot_ttl_s)
        self.meter = meter  # bills each job once it is DONE (off this thread)

    def tokens(
        self, job_id: str, job: dict[str, str] | None = None, ready: dict[str, Any] | None = None
    ) -> Iterator[Token]:
        """The job's tokens, from whichever attempt delivers them. `ready` (with `job`, its
        record) is a hand-off the caller already holds: the first attempt starts from it."""
        jobs = self.s.jobs
        deadline = time.monotonic() + self.s.settings.job_timeout_s
        after = 0
        output: list[int] = []
        info = ready
        while True:
            if info is None:
                info = jobs.wait_ready(job_id, after, max(0.0, deadline - time.monotonic()))
                job = None
            if info is None:
                job = jobs.get(job_id)
                if job["state"] in (JobState.FAILED, JobState.CANCELED):
                    raise JobEnded(job["state"], job.get("error") or job["state"].lower())
                if job["state"] == JobState.DONE:
                    raise JobEnded("DONE", "finished elsewhere")
                self.cancel(job_id, "deadline")
                raise JobEnded("TIMEOUT", f"no result within {self.s.settings.job_timeout_s:g} s")
            attempt = int(info["attempt"])
            after = attempt
            if job is None:
                job = jobs.get(job_id)
            handed, info = info, None
            stub = self._decode_stub(handed["decode_grpc"], handed.get("decode_region", ""))
            remaining = max(1.0, deadline - time.monotonic())
            try:
                if handed["mode"] == "local":
                    stream = stub.Generate(
                        decode_pb2.GenerateRequest(
                            job_id=job_id, token_ids=_ids(job), sampling=sampling(job), timeout_s=remaining
                        ),
                        timeout=remaining + 5,
                    )
                else:
                    kv = common_pb2.KVDescriptor.FromString(base64.b64decode(handed["kv"]))
                    stream = stub.Decode(
                        decode_pb2.DecodeRequest(
                            job_id=job_id, attempt=attempt, first_token=int(handed["first_token"]), kv=kv,
                            sampling=sampling(job), timeout_s=remaining, token_ids=_ids(job),  # vLLM decodes need it
                        ),
                        timeout=remaining + 5,
                    )  # fmt: skip
                first: tuple[float, float] | None = None  # token 0: (wall time, stream elapsed s)
                for event in stream:
                    if event.index == 0:
                        first = (time.time(), event.elapsed_s)
                    if event.index == 0 and handed["mode"] == "split":
                        jobs.transition(job_id, JobState.DECODING, attempt, note="first token", tenant=job["tenant"])
                    if event.index < len(output):
                        continue
                    output.append(event.token)
                    if event.last:  # spend is billed from the ledger (billing/meter.py), not here
                        jobs.transition(
                            job_id, JobState.DONE, attempt, note=event.finish_reason, tenant=job["tenant"],
                            completion_tokens=len(output), finish_reason=event.finish_reason, output_ids=output,
                            **served_timing(first, event.elapsed_s),
                        )  # fmt: skip
                        if self.meter is not None:
                            self.meter.job_done(job_id)
                    yield Token(event.index, event.token, event.last, event.finish_reason)
                    if event.last:
                        return
            except grpc.RpcError as exc:
                log.warning("job %s attempt %d: decode stream ended: %s", job_id, attempt, exc.code().name)
                if exc.code() == grpc.StatusCode.UNAVAILABLE and job.get("decode_instance"):
                    self.s.regions.suspect(f"{job['decode_region']}/{job['decode_instance']}")
                if handed["mode"] == "local":  # nobody else notices a lost local run: start the next attempt
                    self._retry(job_id, attempt, f"local run: {exc.code().name}")
            except (StaleAttempt, IllegalTransition):
                continue  # a newer attempt (or a cancel) took over

    def _decode_stub(self, target: str, region: str) -> decode_pb2_grpc.DecodeRegionStub:
        stub = self._decode_stubs.get((target, region))
        if stub is None:
            channel = self.channels.get(target, server_name(region))
            stub = self._decode_stubs[(target, region)] = decode_pb2_grpc.DecodeRegionStub(channel)
        return stub

    def _retry(self, job_id: str, attempt: int, reason: str) -> None:
        try:
            if attempt >= self.s.settings.max_attempts:
                self.s.jobs.transition(job_id, JobState.FAILED, attempt, note=reason, error=reason)
                return
            self.s.jobs.transition(job_id, JobState.QUEUED, attempt + 1, note=reason)
        except (StaleAttempt, IllegalTransition, JobNotFound):
            return
        enqueue(self.celery, job_id)

    def cancel(self, job_id: str, reason: str) -> bool:
        """CANCELED in the store, then Cancel in both regions (idempotent there)."""
        try:
            self.s.jobs.transition(job_id, JobState.CANCELED, 0, note=reason, error=f"canceled: {reason}")
        except (IllegalTransition, JobNotFound):
            return False
        job = self.s.jobs.get(job_id)
        request = common_pb2.CancelRequest(job_id=job_id, reason=reason)
        for target, region, stub_type in (
            (job.get("decode_grpc"), job.get("decode_region", ""), decode_pb2_grpc.DecodeRegionStub),
            (job.get("prefill_grpc"), job.get("prefill_region", ""), prefill_pb2_grpc.PrefillRegionStub),
        ):
            if not target:
                continue
            try:
                stub_type(self.channels.get(target, server_name(region))).Cancel(request, timeout=2)
            except grpc.RpcError as exc:
                log.warning("cancel of %s in %s: %s", job_id, target, exc.code().name)
        return True


def _ids(job: dict[str, str]) -> list[int]:
    import json

    ids: list[int] = json.loads(job["token_ids"])
    return ids
