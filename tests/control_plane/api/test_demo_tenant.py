"""`prfaas up`'s demo tenant (devstack/tenant.py) through the real admin API: a demo-tenant.json left empty or
corrupt (a crash mid-write, a full disk) is said and replaced, not a JSONDecodeError that failed every later
`up` after the whole stack had started; the file is written whole (0600) and finds the tenant again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cp_kit import ADMIN_KEY, settings_fixture
from fastapi.testclient import TestClient

from prfaas.control_plane.app import create_app
from prfaas.devstack.tenant import demo_tenant
from prfaas.devstack.topology import TenantSpec


@pytest.fixture
def admin() -> Iterator[Any]:
    for settings in settings_fixture():
        with TestClient(create_app(settings)) as client:

            def call(method: str, path: str, body: object = None) -> Any:
                reply = client.request(method, path, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert reply.status_code < 400, reply.text
                return reply.json()

            yield call


@pytest.mark.parametrize("left", ["", "{", "[]"])
def test_an_unreadable_demo_tenant_file_is_replaced(admin: Any, tmp_path: Path, left: str) -> None:
    (tmp_path / "demo-tenant.json").write_text(left)
    said: list[str] = []
    tenant_id, key = demo_tenant(admin, TenantSpec(), tmp_path, said.append)
    assert any("demo-tenant.json" in line for line in said), said
    saved = json.loads((tmp_path / "demo-tenant.json").read_text())
    assert (saved["tenant_id"], saved["api_key"]) == (tenant_id, key)
    assert (tmp_path / "demo-tenant.json").stat().st_mode & 0o777 == 0o600
    assert demo_tenant(admin, TenantSpec(), tmp_path, said.append) == (tenant_id, key)  # found again
    assert not list(tmp_path.glob("*.partial"))
