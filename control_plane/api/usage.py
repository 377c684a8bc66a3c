"""Usage from the ledger: `GET /v1/usage` (the calling tenant), `GET /v1/usage/jobs/{id}` (one job's bill), and
the admin views over all tenants (`GET /admin/usage`, `/admin/usage/jobs/{id}` with wasted attempts).
`format=csv` returns the same rows as CSV.

Windows are [from, to) on the job's finish time, UTC; `from` defaults to the start of the current month, `to`
to now. Dates are ISO 8601 (`2026-11-01` or `2026-11-01T12:00:00Z`)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import re
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query
from fastapi.responses import Response

from prfaas.control_plane.api.deps import AdminDep, MeterDep, TenantDep
from prfaas.control_plane.api.errors import INVALID_RANGE, USAGE_NOT_FOUND
from prfaas.control_plane.api.schemas import AdminJobUsage, UsageEntryPublic, UsageReport, UsageRow, WastedPublic
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.control_plane.billing.queries import GroupTotal
from prfaas.control_plane.billing.spend import month_window

router = APIRouter(prefix="/v1/usage", tags=["usage"])
admin_router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])
MAX_WINDOW = dt.timedelta(days=400)
TenantGroupBy = Literal["day", "region", "phase", "model"]
AdminGroupBy = Literal["day", "region", "phase", "model", "tenant"]


From = Annotated[dt.datetime | None, Query(alias="from", description="start (inclusive), ISO 8601; UTC if naive")]
To = Annotated[dt.datetime | None, Query(alias="to", description="end (exclusive), ISO 8601; default now")]
Format = Annotated[Literal["json", "csv"], Query(description="json, or csv (the rows only)")]


def window(start: dt.datetime | None, end: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    def utc(t: dt.datetime, param: str) -> dt.datetime:
        try:
            return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t.astimezone(dt.UTC)
        except OverflowError:  # 9999-12-31T23:59-23:59 is past year 9999 in UTC
            message = f"invalid range: {param} is outside the years 1-9999 in UTC"
            raise INVALID_RANGE.error(message, param=param) from None

    s = utc(start, "from") if start is not None else month_window()[0]
    e = utc(end, "to") if end is not None else dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    if e <= s:
        raise INVALID_RANGE.error("invalid range: to must be after from", param="to")
    if e - s > MAX_WINDOW:
        raise INVALID_RANGE.error(f"invalid range: at most {MAX_WINDOW.days} days", param="from")
    return s, e


def entry_public(e: UsageEntry) -> UsageEntryPublic:
    return UsageEntryPublic.model_validate(
        {name: getattr(e, name) for name in UsageEntryPublic.model_fields} | {"finished_at": e.finished_at}
    )


def _report(rows: list[GroupTotal], tenant: str | None, s: dt.datetime, e: dt.datetime, group_by: str) -> UsageReport:
    data = [UsageRow(**r.model_dump()) for r in rows]
    return UsageReport(tenant=tenant, start=s, end=e, group_by=group_by, data=data)


def _render(report: UsageReport, fmt: str) -> UsageReport | Response:
    if fmt == "json":
        return report
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    fields = list(UsageRow.model_fields)
    writer.writerow([report.group_by, *fields[1:]])
    for row in report.data:
        writer.writerow([getattr(row, f) for f in fields])
    name = f"usage-{report.tenant or 'all'}-{report.group_by}-{report.start:%Y%m%d}-{report.end:%Y%m%d}.csv"
    return Response(out.getvalue(), media_type="text/csv", headers={"Content-Disposition": _attachment(name)})


def _attachment(name: str) -> str:
    """A Content-Disposition for `name` whatever it holds (a tenant may be named in any
    script; headers are latin-1): an ASCII fallback plus the exact UTF-8 name (RFC 6266)."""
    fallback = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(name, safe='')}"


@router.get("", response_model=UsageReport)
def tenant_usage(
    tenant: TenantDep,
    m: MeterDep,
    start: From = None,
    end: To = None,
    group_by: TenantGroupBy = "day",
    format: Format = "json",
) -> UsageReport | Response:
    s, e = window(start, end)
    return _render(_report(m.ledger.totals(tenant.id, s, e, group_by), tenant.id, s, e, group_by), format)


@router.get("/jobs/{job_id}")
def tenant_job_usage(job_id: str, tenant: TenantDep, m: MeterDep) -> UsageEntryPublic:
    entry = m.ledger.entry(job_id) if len(job_id) <= 64 else None
    if entry is None or entry.tenant != tenant.id:
        raise USAGE_NOT_FOUND.error()
    return entry_public(entry)


@admin_router.get("/usage", response_model=UsageReport)
def admin_usage(
    m: MeterDep,
    start: From = None,
    end: To = None,
    group_by: AdminGroupBy = "tenant",
    tenant: Annotated[str | None, Query(max_length=128)] = None,
    format: Format = "json",
) -> UsageReport | Response:
    s, e = window(start, end)
    return _render(_report(m.ledger.totals(tenant, s, e, group_by), tenant, s, e, group_by), format)


@admin_router.get("/usage/jobs/{job_id}")
def admin_job_usage(job_id: str, m: MeterDep) -> AdminJobUsage:
    if len(job_id) > 64:
        raise USAGE_NOT_FOUND.error()
    entry = m.ledger.entry(job_id)
    wasted = [WastedPublic.model_validate(w, from_attributes=True) for w in m.ledger.wasted(job_id)]
    if entry is None and not wasted:
        raise USAGE_NOT_FOUND.error()
    return AdminJobUsage(entry=entry_public(entry) if entry else None, wasted=wasted)
