"""The API's calls to a job's regions (jobs/generation.py follows the job with them): the channel options,
the decode stream a hand-off starts (Decode for a split job, Generate for a local one), Cancel in both
regions, and what a decode stream's status says about who is to blame.

A decode region that ends a reservation because the prefill instance that owed its KV was lost (its health
stream broke: decode_region/peer_watch.py) answers `PREFILL_LOST` (ABORTED: no other status of the decode
region's, and never one gRPC itself makes), not UNAVAILABLE: the decode instance is healthy, the prefill
instance is not, and the KV it holds is no use (it may hang, not be gone)."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from prfaas.control_plane.jobs.prefix import cache_salt
from prfaas.control_plane.jobs.records import sampling
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from prfaas.region.channels import ChannelCache, TlsFiles, keepalive_options
from prfaas.telemetry import tracing
from prfaas.transport.identity import server_name

log = logging.getLogger(__name__)
# A region that hangs mid-stream (SIGSTOP, a host gone silent) breaks its calls within this and max(2 s, this)
# (an unanswered keepalive ping), not at the call's deadline; the regions' servers permit pings this often.
KEEPALIVE_S = 5.0
PREFILL_LOST = grpc.StatusCode.ABORTED  # a Decode's status when the prefill instance that owed its KV was lost
CANCEL_TIMEOUT_S = 2.0


def region_channels(tls: TlsFiles | None) -> ChannelCache:
    """The channels to the regions, with keepalive (`KEEPALIVE_S`)."""
    # Not `SingleThreadedUnaryStream` (it saved ~0.2 ms a request, a thread to pump an idle channel's
    # events): its calls are freed only when their reader consumes their last events, and a cancelled
    # one's never are (every call of the soak's API stayed in memory, ~2.5 MB/min).
    return ChannelCache(tls, keepalive_options(KEEPALIVE_S))


def start_decode(
    stub: decode_pb2_grpc.DecodeRegionStub, job_id: str, job: dict[str, str], handed: dict[str, Any], attempt: int,
    timeout_s: float, metadata: Any,
) -> Any:  # fmt: skip
    """The token stream of the hand-off `handed` of `attempt`: Generate (local) or Decode (split), its call's
    deadline `timeout_s` (the job's: the stream never outlives it)."""
    if handed["mode"] == "local":
        local = decode_pb2.GenerateRequest(
            job_id=job_id, token_ids=_ids(job), sampling=sampling(job), timeout_s=timeout_s, attempt=attempt
        )
        if (salt := cache_salt(job)) is not None:
            local.cache_salt = salt
        return stub.Generate(local, timeout=timeout_s, metadata=metadata)
    kv = common_pb2.KVDescriptor.FromString(base64.b64decode(handed["kv"]))
    request = decode_pb2.DecodeRequest(
        job_id=job_id, attempt=attempt, first_token=int(handed["first_token"]), kv=kv,
        sampling=sampling(job), timeout_s=timeout_s, token_ids=_ids(job),  # vLLM, penalties need it
    )  # fmt: skip
    if handed.get("first_logprobs"):
        request.first_logprobs.ParseFromString(base64.b64decode(handed["first_logprobs"]))
    for choice in handed.get("choices") or ():
        request.choices.add().ParseFromString(base64.b64decode(choice))
    for position in handed.get("prompt_logprobs") or ():
        request.prompt_logprobs.add().ParseFromString(base64.b64decode(position))
    if (salt := cache_salt(job)) is not None:
        request.cache_salt = salt
    return stub.Decode(request, timeout=timeout_s, metadata=metadata)


def cancel_in_regions(channels: ChannelCache, job_id: str, job: dict[str, str], reason: str, wait: bool) -> None:
    """Cancel `job` in its decode and prefill regions (idempotent there), both calls at once; a local job whose
    prefill endpoint is its decode region's in that region alone (a decode-only server answers PrefillRegion
    UNIMPLEMENTED); a local one reshipped from a prefill region's lease is canceled there too.
    `wait`: return once both answered (`CANCEL_TIMEOUT_S` at most); else at once (a hung region keeps no caller
    waiting)."""
    request = common_pb2.CancelRequest(job_id=job_id, reason=reason)
    calls = []
    alone = job.get("placement_chosen") == "local" and job.get("prefill_grpc") == job.get("decode_grpc")
    for target, region, stub_type in (
        (job.get("decode_grpc"), job.get("decode_region", ""), decode_pb2_grpc.DecodeRegionStub),
        (None if alone else job.get("prefill_grpc"), job.get("prefill_region", ""), prefill_pb2_grpc.PrefillRegionStub),
    ):
        if target:
            stub = stub_type(channels.get(target, server_name(region)))
            calls.append((target, stub.Cancel.future(request, timeout=CANCEL_TIMEOUT_S)))

    def answered() -> None:  # holds the calls until they end: a call dropped before is cancelled (its __del__)
        for target, call in calls:
            try:
                call.result()
            except grpc.RpcError as exc:
                log.warning("cancel of %s in %s: %s", job_id, target, exc.code().name)

    if wait:
        answered()
    elif calls:
        threading.Thread(target=answered, name=f"cancel-{job_id[:8]}", daemon=True).start()


def _ids(job: dict[str, str], field: str = "token_ids") -> list[int]:
    return list(json.loads(job.get(field) or "[]"))


@contextlib.contextmanager
def released(stream: Any) -> Iterator[threading.Event]:
    """Ends a decode stream however its reading ends: set the event once the job is DONE; else (an error, the
    client gone and the generator closed) the call is cancelled now, so the region stops generating at once
    rather than when the garbage collector reaches the call."""
    finished = threading.Event()
    try:
        yield finished
    finally:
        if not finished.is_set():
            stream.cancel()


def trace_parent(span: tracing.Span | None, job: dict[str, str]) -> Any:
    """The context a decode call's span is started in: the job's span in this process, else its record's trace."""
    return tracing.set_span_in_context(span) if span is not None else tracing.from_traceparent(job.get("trace"))
