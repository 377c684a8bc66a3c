"""A request whose Idempotency-Key names a job already (a retry): attached to that job, it reads the job's
tokens from its log (jobs/attached.py) instead of running it again."""

from __future__ import annotations

import json

from prfaas.control_plane.api.choices import Choice
from prfaas.control_plane.api.deps import Generation
from prfaas.control_plane.api.errors import JOB_NOT_FOUND
from prfaas.control_plane.api.sse import PromptJob
from prfaas.control_plane.jobs.errors import JobNotFound


def attach(g: Generation, job_id: str, choices: list[Choice], *, anyway: bool = False) -> PromptJob | None:
    """The job an earlier request with the same Idempotency-Key (and body) started: its tokens, from its log
    or its record (jobs/tokenlog.py), never a second run. Counted as its reader before its record is read: None
    (unless `anyway`) when the job was canceled as its client left before then (the request gets a fresh job)."""
    reader = g.follower.attached(job_id)  # from now, the job's own client leaving does not cancel it
    try:
        job = g.services.jobs.get(job_id)
    except JobNotFound:
        reader.close()
        raise JOB_NOT_FOUND.error() from None
    except BaseException:
        reader.close()
        raise
    if not anyway and job.get("state") == "CANCELED" and job.get("client_left") == "1":
        reader.close()
        return None
    for choice in choices:
        choice.prompt_ids = json.loads(job.get("token_ids") or "[]")
    return PromptJob(job_id, reader, int(job.get("prompt_tokens", 0) or 0), choices, leader=False)


def attached_anyway(g: Generation, job_id: str, choices: list[Choice]) -> PromptJob:
    attached = attach(g, job_id, choices, anyway=True)
    assert attached is not None
    return attached
