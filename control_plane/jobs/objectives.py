"""What a job asks of its placement besides its prompt: latency objectives and consent to a
lossy KV codec.

Each comes from the request's `prfaas` extension (`ttft_slo_ms`, `tpot_slo_ms`, `kv_codec`),
else from its tenant's defaults, else from the control plane's settings (`ttft_slo_ms`,
`tpot_slo_ms`; codec `lossless`), and is written on the job at admission, so the placement,
every retry and GET /v1/jobs/{id} see the same. `kv_codec` is `lossless` (the KV crosses the
WAN bit for bit) or the name of one of the policy's lossy codecs: the scheduler may then use
that codec where it pays (a slow link), and never another lossy one.
"""

from __future__ import annotations

from collections.abc import Mapping

from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import Objectives

LOSSLESS = "lossless"


def job_fields(asked: Objectives, tenant: Objectives, settings: Settings) -> dict[str, str]:
    """The job's objectives, resolved request > tenant > settings, as job fields."""
    ttft = asked.ttft_slo_ms or tenant.ttft_slo_ms or settings.ttft_slo_ms
    tpot = asked.tpot_slo_ms or tenant.tpot_slo_ms or settings.tpot_slo_ms
    codec = asked.kv_codec or tenant.kv_codec or LOSSLESS
    return {"ttft_slo_ms": repr(float(ttft)), "tpot_slo_ms": repr(float(tpot)), "kv_codec": codec}


def slo_ms(job: Mapping[str, str], settings: Settings) -> tuple[float, float]:
    """(TTFT, TPOT) objectives of a job, ms (a job from before the fields: the settings')."""
    return float(job.get("ttft_slo_ms") or settings.ttft_slo_ms), float(job.get("tpot_slo_ms") or settings.tpot_slo_ms)


def lossy_codec(job: Mapping[str, str]) -> str | None:
    """The lossy codec the job consented to; None: lossless only."""
    codec = job.get("kv_codec") or LOSSLESS
    return None if codec == LOSSLESS else codec
