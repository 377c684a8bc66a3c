"""What a job's record (its hash in the store) says, read the same way by the dispatcher, the API's admission
placer and its follower: the request the scheduler is asked to place, the sampling specification, the fields a
placement writes and an attempt's hand-off."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from prfaas.control_plane.fleet.records import InstanceRecord
from prfaas.control_plane.jobs.objectives import lossy_codec, slo_ms
from prfaas.control_plane.jobs.prefix import prefix_hashes
from prfaas.control_plane.scheduling.decision import Decision, decision_dict
from prfaas.control_plane.scheduling.request import Request, Slo
from prfaas.control_plane.settings import Settings
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import common_pb2, prefill_pb2
from prfaas.region.requests import sampling_to_proto


def job_request(job: Mapping[str, str], settings: Settings) -> Request:
    """What the scheduler is asked to place for `job` (its hash in the store)."""
    ttft_ms, tpot_ms = slo_ms(job, settings)
    lossy = lossy_codec(job)
    return Request(
        request_id=job["id"],
        tenant=job["tenant"],
        prompt_tokens=int(job["prompt_tokens"]),
        max_new_tokens=int(job["max_new_tokens"]) * job_sampling(job).n,  # n choices decode, one prefill
        slo=Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms),
        prefix_block_hashes=prefix_hashes(job),
        block_tokens=settings.prefix.block_tokens,
        allow_lossy_codec=lossy is not None,
        lossy_codec=lossy,
    )


def placed_fields(decision: Decision, decode: InstanceRecord, prefill: InstanceRecord) -> dict[str, Any]:
    """The job fields that record `decision` and the instances running it (GET /v1/jobs shows them)."""
    return {
        "decision": decision_dict(decision), "placement_chosen": decision.mode.value, "decode_region": decode.name,
        "prefill_region": prefill.name, "decode_instance": decode.instance, "prefill_instance": prefill.instance,
        "decode_grpc": decode.grpc_endpoint, "prefill_grpc": prefill.grpc_endpoint,
        "cost_usd": decision.cost.total_usd, "colocated_cost_usd": decision.colocated_cost.total_usd,
        "codec": decision.codec or "",
        # the incarnations placed (jobs/attempts.py: a failure leaves out that one, not one registered since)
        "decode_registered_at": decode.registered_at, "prefill_registered_at": prefill.registered_at,
    }  # fmt: skip


def ready_info(mode: str, decode: InstanceRecord, **fields: Any) -> dict[str, Any]:
    """An attempt's hand-off: where the API process streams its tokens from."""
    return {"mode": mode, "decode_grpc": decode.grpc_endpoint, "decode_region": decode.name} | fields


def first_fields(done: prefill_pb2.PrefillDone | prefill_pb2.ReshipReply) -> dict[str, Any]:
    """The hand-off's first token (chosen at prefill), its logprobs when asked, and every choice's first
    token when the job asked for n > 1 (each a serialized FirstToken, base64)."""
    first: dict[str, Any] = {"first_token": done.first_token}
    if done.HasField("first_logprobs"):
        first["first_logprobs"] = base64.b64encode(done.first_logprobs.SerializeToString()).decode()
    if done.choices:
        first["choices"] = [base64.b64encode(c.SerializeToString()).decode() for c in done.choices]
    if done.prompt_logprobs:
        first["prompt_logprobs"] = [base64.b64encode(p.SerializeToString()).decode() for p in done.prompt_logprobs]
    return first


def job_sampling(job: Mapping[str, str]) -> SamplingParams:
    """The job's sampling specification (its `sampling` field, written by the API)."""
    if job.get("sampling"):
        return SamplingParams.from_dict(json.loads(job["sampling"]))
    seed = int(job["seed"]) if job.get("seed") else None  # a record from before the field: temperature, seed
    return SamplingParams(int(job["max_new_tokens"]), float(job.get("temperature", 0) or 0), seed=seed)


def sampling(job: Mapping[str, str]) -> common_pb2.SamplingParams:
    return sampling_to_proto(job_sampling(job))
