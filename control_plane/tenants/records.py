"""What a tenant is, as the rest of the control plane sees it: `Tenant` (its `Quota`), `ApiKey`, the changes an
operator makes (`TenantChanges`) and the errors of lookups. A key is `pfk-<key id>-<secret>`; only its SHA-256
is stored (keys are 192-bit random, so a fast hash is enough)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from enum import StrEnum

KEY_PREFIX = "pfk-"
MAX_KEY_CHARS = 128

__all__ = [  # what the package re-exports (tenants/__init__.py)
    "KEY_PREFIX",
    "ApiKey",
    "KeyNotFound",
    "Objectives",
    "Quota",
    "Tenant",
    "TenantChanges",
    "TenantNotFound",
    "TenantStatus",
    "digest",
]


class TenantStatus(StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"


@dataclass(frozen=True)
class Quota:
    """A tenant's admission limits (checked by the job store's admission script): requests per second,
    concurrent jobs, and $ per calendar month."""

    rps: float
    concurrency: int
    budget_usd: float


@dataclass(frozen=True)
class Objectives:
    """What a tenant's requests ask of their placement when they do not say (control_plane/jobs/objectives.py):
    TTFT and TPOT objectives (ms) and the KV codec consented to; None: the control plane's default."""

    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    kv_codec: str | None = None


class TenantNotFound(Exception):
    pass


class KeyNotFound(Exception):
    pass


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    status: TenantStatus
    quota: Quota
    allow_placement: bool  # may requests ask for their placement (local / split)
    created_at: float  # epoch s
    objectives: Objectives = Objectives()  # its requests' defaults


@dataclass(frozen=True)
class TenantChanges:
    """What an operator sets on a tenant (`TenantStore.create`, `update`); None leaves a field as it is."""

    status: TenantStatus | None = None
    rps: float | None = None
    concurrency: int | None = None
    budget_usd: float | None = None
    allow_placement: bool | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    kv_codec: str | None = None

    def fields(self) -> dict[str, str | float | int | bool]:
        """The fields these changes set (columns of the `tenants` table), None ones left out."""
        values = dataclasses.asdict(self) | {"status": None if self.status is None else self.status.value}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant: str
    revoked: bool
    created_at: float  # epoch s


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def well_formed(presented: str) -> bool:
    return presented.startswith(KEY_PREFIX) and len(presented) <= MAX_KEY_CHARS
