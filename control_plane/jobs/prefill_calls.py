"""The worker's calls to a prefill region once an attempt is placed (jobs/dispatch.py): `Prefill` (the prompt
computed and its KV shipped to the reserved decode instance) and `Reship` (KV a prefill instance still leases,
shipped to a new decode instance), each followed on the worker's watcher loop (jobs/watcher.py) to the hand-off
and the shipment's end. A call that fails costs the attempt: the next is queued (jobs/attempts.py) leaving that
prefill instance out, and the decode reservation is released. Following that fails for a reason of ours (Redis
away past its retries) leaves the stage's lease in place: the sweeper takes the attempt back at its deadline."""

from __future__ import annotations

import base64
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from prfaas.control_plane.fleet.records import InstanceRecord
from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.errors import IllegalTransition, JobNotFound, StaleAttempt
from prfaas.control_plane.jobs.leases import Leases
from prfaas.control_plane.jobs.records import first_fields, ready_info
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.watcher import Watcher
from prfaas.control_plane.services import Services
from prfaas.protos.prfaas.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prfaas.telemetry import tracing
from prfaas.transport.identity import server_name

log = logging.getLogger(__name__)


class AttemptFailed(Exception):
    """This attempt cannot finish; the instance (`region/instance` key) is left out of the next one."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(reason)
        self.where = where


def attempt_failed(services: Services, where: str, step: str, exc: grpc.RpcError) -> AttemptFailed:
    """A call to `where` (`region/instance`) that failed at `step`: every code costs the attempt (the next tries
    elsewhere); an UNAVAILABLE instance is suspected, so no one sends it new work until it beats again."""
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        services.regions.suspect(where)
    reason = f"{step} in {where}: {exc.code().name} {exc.details() or ''}".strip()
    return AttemptFailed(where, reason)


@dataclass(frozen=True)
class Started:
    """An attempt whose prefill (or reship) is under way, as its watcher coroutine knows it."""

    job_id: str
    tenant: str
    attempt: int
    kv_bytes: int  # raw KV bytes the shipment carries (the prompt's, but a prefix the decode region holds)
    decode: InstanceRecord
    prefill: InstanceRecord
    lease_s: float
    span: tracing.Span  # the dispatch's: the prefill (or reship) call's parent

    def call_span(self, name: str) -> tracing.Span:
        """The span of this attempt's call to its prefill region (the callee's parent)."""
        return tracing.tracer.start_span(
            name, context=tracing.set_span_in_context(self.span), kind=tracing.SpanKind.CLIENT,
            attributes={tracing.JOB_ID: self.job_id, "prfaas.prefill_region": self.prefill.key},
        )  # fmt: skip


class PrefillCalls:
    """Starts and follows an attempt's call to its prefill region, on the watcher's loop."""

    def __init__(self, services: Services, leases: Leases, attempts: Attempts, watcher: Watcher) -> None:
        self.s = services
        self.leases = leases
        self.attempts = attempts
        self.watcher = watcher

    def prefill(self, run: Started, request: prefill_pb2.PrefillRequest) -> None:
        self.watcher.submit(self._follow_prefill(run, request))

    def reship(self, run: Started, request: prefill_pb2.ReshipRequest) -> None:
        self.watcher.submit(self._follow_reship(run, request))

    async def _follow_prefill(self, run: Started, request: prefill_pb2.PrefillRequest) -> None:
        """On the watcher's loop: the prefill's events, to the end of its shipment."""
        jobs = self.s.jobs
        channel = self.watcher.channel(run.prefill.grpc_endpoint, server_name(run.prefill.name))
        span = run.call_span("worker.prefill")
        lost = handed = False
        call = prefill_pb2_grpc.PrefillRegionStub(channel).Prefill(request, timeout=run.lease_s + 5,
                                                                   metadata=tracing.metadata(span))  # fmt: skip
        try:
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "prefill_done":
                    done = event.prefill_done
                    jobs.transition(run.job_id, JobState.TRANSFERRING, run.attempt, note="prefill done, KV shipping",
                                    tenant=run.tenant)  # fmt: skip
                    # The decode region answers only once all KV arrived, so by the time the job
                    # can read DONE its raw bytes have been shipped: record them now, before the
                    # hand-off (the prefill region's shipment_complete event may come after DONE).
                    jobs.update(run.job_id, run.attempt, bytes_raw=run.kv_bytes, prefill_gpu_s=done.prefill_s,
                                cached_tokens=done.cached_tokens)  # fmt: skip
                    kv = base64.b64encode(done.kv.SerializeToString()).decode()
                    first = first_fields(done)
                    jobs.post_ready(run.job_id, run.attempt, ready_info("split", run.decode, kv=kv, **first))
                    handed = True  # decoding from here on: what follows is bookkeeping
                elif kind == "shipment_complete":
                    shipped = event.shipment_complete
                    jobs.update(run.job_id, run.attempt, bytes_raw=shipped.raw_bytes, bytes_wire=shipped.wire_bytes)
        except grpc.aio.AioRpcError as exc:
            tracing.failed(span, exc.code().name)
            await self._stage_failed(run, "prefill", exc)
        except (StaleAttempt, IllegalTransition, JobNotFound):
            call.cancel()  # the job moved on (canceled, or the sweeper started the next attempt)
        except Exception as exc:
            if handed:  # the job decodes: it must not be taken back for a lost byte count (its span: failed)
                tracing.failed(span, exc)
                log.warning("job %s attempt %d: after its hand-off: %r", run.job_id, run.attempt, exc)
            else:
                lost = True
                call.cancel()
                self._lost(run, "prefill", span, exc)
        finally:
            span.end()
            if not lost:
                self.leases.take(run.job_id, run.attempt)

    async def _follow_reship(self, run: Started, request: prefill_pb2.ReshipRequest) -> None:
        """On the watcher's loop: the leased KV shipped to the new decode instance, then its hand-off."""
        jobs = self.s.jobs
        channel = self.watcher.channel(run.prefill.grpc_endpoint, server_name(run.prefill.name))
        span = run.call_span("worker.reship")
        lost = False
        try:
            reply = await prefill_pb2_grpc.PrefillRegionStub(channel).Reship(
                request, timeout=run.lease_s + 5, metadata=tracing.metadata(span)
            )
            jobs.transition(run.job_id, JobState.TRANSFERRING, run.attempt, note="reshipped", tenant=run.tenant)
            jobs.update(run.job_id, run.attempt, bytes_raw=reply.shipment.raw_bytes,
                        bytes_wire=reply.shipment.wire_bytes, reship_from="")  # fmt: skip
            kv = base64.b64encode(reply.kv.SerializeToString()).decode()
            first = first_fields(reply)
            jobs.post_ready(run.job_id, run.attempt, ready_info("split", run.decode, kv=kv, **first))
        except grpc.aio.AioRpcError as exc:  # lease gone, region down: the next attempt computes the prompt again
            tracing.failed(span, exc.code().name)
            await self._stage_failed(run, "reship", exc, reship_from="")
        except (StaleAttempt, IllegalTransition, JobNotFound):
            pass
        except Exception as exc:
            lost = True
            self._lost(run, "reship", span, exc)
        finally:
            span.end()
            if not lost:
                self.leases.take(run.job_id, run.attempt)

    @staticmethod
    def _lost(run: Started, step: str, span: tracing.Span, exc: Exception) -> None:
        """Following the stage failed for a reason of ours (Redis away past its retries): its lease is left in place,
        so the sweeper takes the attempt back at its deadline; taken here, nothing would ever move the job on."""
        log.error("job %s attempt %d: following its %s failed (%r); the sweeper takes it back at its lease's end",
                  run.job_id, run.attempt, step, exc)  # fmt: skip
        tracing.failed(span, exc)

    async def _stage_failed(self, run: Started, step: str, exc: grpc.aio.AioRpcError, **fields: Any) -> None:
        """The next attempt first (moved under its own lease, in place of this one's, before this process may die),
        then the reservation released. A sweeper that took the lease back may fail it too: one of the two moves it."""
        failed = attempt_failed(self.s, run.prefill.key, step, exc)
        self.attempts.fail(run.job_id, run.attempt, failed.where, str(failed), **fields)
        channel = self.watcher.channel(run.decode.grpc_endpoint, server_name(run.decode.name))
        with contextlib.suppress(grpc.aio.AioRpcError):  # else the reservation expires on its own (ttl_s)
            release = decode_pb2.ReleaseRequest(job_id=run.job_id, attempt=run.attempt)  # that attempt's only
            await decode_pb2_grpc.DecodeRegionStub(channel).Release(release, timeout=5)
