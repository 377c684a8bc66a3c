"""schemathesis against the app's OpenAPI schema (in-process, real Redis), authenticated as
a tenant for /v1 and as the admin for /admin: no 5xx on any generated request. The two
generation routes are fuzzed too, but this app has no region: a request they admit (`model` may be
omitted now, as vLLM takes it) waits its job's 0.2 s deadline and ends 504 `job_timeout`, the one 5xx
expected there (served answers: tests/control_plane/api/test_api_e2e.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from cp_kit import ADMIN_KEY, settings_fixture
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings

from prfaas.control_plane.app import create_app


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[FastAPI, str]]:
    for s in settings_fixture(job={"timeout_s": 0.2}):
        application = create_app(s)
        with TestClient(application) as client:
            tenant = client.post(
                "/admin/tenants", json={"name": "fuzz"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
            )
            key = client.post(
                f"/admin/tenants/{tenant.json()['id']}/keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
            )
            yield application, key.json()["key"]


@pytest.fixture(scope="module")
def api_schema(app: tuple[FastAPI, str]) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", app[0])


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: Any, app: tuple[FastAPI, str]) -> None:
    token = ADMIN_KEY if case.path.startswith("/admin") else app[1]
    response = case.call(headers={"Authorization": f"Bearer {token}"})
    if case.path.endswith("completions") and response.status_code == 504:  # admitted; no region to run it
        assert response.json()["error"]["code"] == "job_timeout", response.text[:200]
        return
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:200])
