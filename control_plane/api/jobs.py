"""Jobs of the caller's tenant: GET one (state, timeline, placement, bytes, cost), list,
DELETE (cancel). Another tenant's job is 404, exactly like a job that does not exist."""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter

from prfaas.control_plane.api.deps import FollowerDep, ServicesDep, TenantDep
from prfaas.control_plane.api.errors import JOB_NOT_FOUND
from prfaas.control_plane.api.schemas import JobList, JobPublic, TimelineEntry, Usage
from prfaas.control_plane.jobs.errors import JobNotFound
from prfaas.control_plane.services import Services

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def job_public(s: Services, job: dict[str, str]) -> JobPublic:
    prompt = int(job.get("prompt_tokens", 0))
    completion = int(job.get("completion_tokens") or job.get("cut_tokens") or 0)  # cut: what a canceled job sent
    return JobPublic(
        id=job["id"], state=job["state"], attempt=int(job["attempt"]), model=job.get("model", ""),
        created_at=float(job["created_at"]), updated_at=float(job["updated_at"]),
        placement_asked=job.get("placement_asked", "auto"), placement_chosen=job.get("placement_chosen"),
        prefill_region=job.get("prefill_region"), decode_region=job.get("decode_region"),
        prefill_instance=job.get("prefill_instance"), decode_instance=job.get("decode_instance"),
        bytes_raw=int(job.get("bytes_raw", 0)), bytes_wire=int(job.get("bytes_wire", 0)),
        cost_usd=float(job.get("cost_usd", 0.0)), colocated_cost_usd=float(job.get("colocated_cost_usd", 0.0)),
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
        finish_reason=job.get("finish_reason"), error=job.get("error"),
        timeline=[TimelineEntry.model_validate(e) for e in s.jobs.timeline(job["id"])],
        decision=json.loads(job["decision"]) if job.get("decision") else None,
        user=job.get("user"), stop_reason=job.get("stop_reason") or None,
        sampling=json.loads(job["sampling"]) if job.get("sampling") else None,
        cached_tokens=int(job.get("cached_tokens", 0) or 0),
        ttft_slo_ms=float(job["ttft_slo_ms"]) if job.get("ttft_slo_ms") else None,
        tpot_slo_ms=float(job["tpot_slo_ms"]) if job.get("tpot_slo_ms") else None,
        kv_codec=job.get("kv_codec") or "lossless",
    )  # fmt: skip


def _owned(s: Services, tenant_id: str, job_id: str) -> dict[str, str]:
    try:
        uuid.UUID(job_id)
        return s.jobs.get_for(tenant_id, job_id)
    except (ValueError, JobNotFound):
        raise JOB_NOT_FOUND.error() from None


@router.get("")
def list_jobs(tenant: TenantDep, s: ServicesDep) -> JobList:
    return JobList(data=[job_public(s, job) for job in s.jobs.list_for(tenant.id)])


@router.get("/{job_id}")
def get_job(job_id: str, tenant: TenantDep, s: ServicesDep) -> JobPublic:
    return job_public(s, _owned(s, tenant.id, job_id))


@router.delete("/{job_id}")
def cancel_job(job_id: str, tenant: TenantDep, s: ServicesDep, follower: FollowerDep) -> JobPublic:
    _owned(s, tenant.id, job_id)
    follower.cancel(job_id, "canceled by the tenant", by_client=True)
    return job_public(s, s.jobs.get(job_id))
