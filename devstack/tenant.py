"""The demo tenant of a `prfaas up` deployment: created at its first `up`, found again at the next.

Its id and key are kept in `demo-tenant.json` (mode 0600) beside the deployment's database
(`$PRFAAS_HOME/deployments/<name>/`), which `prfaas down` keeps: a second `up` of the topology finds
the tenant (its limits brought to the topology's) and prints the key it had, unless an operator revoked
it (then a new one is issued)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prfaas.devstack.topology import TenantSpec

Admin = Callable[..., Any]  # (method, path, body=None) -> the admin API's JSON reply


def demo_tenant(admin: Admin, spec: TenantSpec, folder: Path, say: Callable[[str], None]) -> tuple[str, str]:
    """(tenant id, API key) of the topology's tenant, through the admin API."""
    limits = {"rps": spec.rps, "concurrency": spec.concurrency, "budget_usd": spec.budget_usd,
              "allow_placement": spec.allow_placement}  # fmt: skip
    path = folder / "demo-tenant.json"
    saved = _saved(path, say)
    known = {str(x["id"]) for x in admin("GET", "/admin/tenants")}
    if saved.get("tenant_id") in known:
        tenant_id = saved["tenant_id"]
        admin("PATCH", f"/admin/tenants/{tenant_id}", limits)
        say(f"tenant {spec.name} ({tenant_id}): found again, with its usage")
    else:
        tenant_id = str(admin("POST", "/admin/tenants", {"name": spec.name} | limits)["id"])
        saved = {"tenant_id": tenant_id}
        say(f"tenant {spec.name} ({tenant_id}): created")
    keys = {str(k["id"]): k for k in admin("GET", f"/admin/tenants/{tenant_id}/keys")}
    kept = keys.get(saved.get("key_id", ""))
    if kept is None or kept["revoked"] or not saved.get("api_key"):
        issued = admin("POST", f"/admin/tenants/{tenant_id}/keys")
        saved |= {"key_id": str(issued["id"]), "api_key": str(issued["key"])}
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")  # written whole, then renamed: never a half-written file
    partial.touch(mode=0o600)
    partial.chmod(0o600)
    partial.write_text(json.dumps(saved, indent=2) + "\n")
    partial.replace(path)
    return tenant_id, saved["api_key"]


def _saved(path: Path, say: Callable[[str], None]) -> dict[str, str]:
    """What `path` kept: {} when there is none, or when it cannot be read (a new tenant and key are made)."""
    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        say(f"{path} is unreadable ({exc}); a new demo tenant and key are made")
        return {}
    if not isinstance(saved, dict):
        say(f"{path} holds no tenant; a new demo tenant and key are made")
        return {}
    return {str(k): str(v) for k, v in saved.items()}
