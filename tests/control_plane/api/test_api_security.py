"""The API's security rules and admission against the real Redis (the app in-process):
another tenant's jobs are 404 like missing ones, a revoked key is 401, admin routes refuse
tenant keys, bad input is a 4xx with a stable message (OpenAI's error object under /v1, `detail`
under /admin), keys are stored hashed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy.exc
from cp_kit import ADMIN_KEY, postgres_database, settings_fixture
from fastapi.testclient import TestClient

from prfaas.control_plane.app import create_app
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import Quota

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def openai_error(message: str, type: str, code: str, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@pytest.fixture
def client() -> Iterator[TestClient]:
    for settings in settings_fixture():
        with TestClient(create_app(settings)) as test_client:
            yield test_client


def _tenant(client: TestClient, name: str, **fields: object) -> tuple[str, dict[str, str]]:
    tenant = client.post("/admin/tenants", json={"name": name} | fields, headers=ADMIN)
    assert tenant.status_code == 201, tenant.text
    key = client.post(f"/admin/tenants/{tenant.json()['id']}/keys", headers=ADMIN)
    assert key.status_code == 201
    return tenant.json()["id"], {"Authorization": f"Bearer {key.json()['key']}"}


def _services(client: TestClient) -> Services:
    services: Services = client.app.state.services  # type: ignore[attr-defined]
    return services


def _job(client: TestClient, tenant_id: str) -> str:
    quota = Quota(rps=100, concurrency=100, budget_usd=100)
    return _services(client).jobs.create(tenant_id, {"model": "tiny-llama", "prompt_tokens": 3}, quota).job_id


def test_other_tenants_jobs_are_not_found(client: TestClient) -> None:
    a_id, a = _tenant(client, "a")
    b_id, b = _tenant(client, "b")
    job_b = _job(client, b_id)

    assert client.get(f"/v1/jobs/{job_b}", headers=b).json()["state"] == "QUEUED"
    mine = client.get(f"/v1/jobs/{job_b}", headers=a)
    missing = client.get("/v1/jobs/00000000-0000-4000-8000-000000000000", headers=a)
    assert (
        (mine.status_code, mine.json())
        == (missing.status_code, missing.json())
        == (404, openai_error("job not found", "not_found_error", "job_not_found"))
    )
    assert client.delete(f"/v1/jobs/{job_b}", headers=a).status_code == 404
    assert client.get(f"/v1/jobs/{job_b}", headers=b).json()["state"] == "QUEUED"  # not canceled by A
    assert client.get("/v1/jobs", headers=a).json()["data"] == []
    assert [j["id"] for j in client.get("/v1/jobs", headers=b).json()["data"]] == [job_b]
    assert client.get("/v1/jobs/not-a-uuid", headers=a).status_code == 404
    assert _services(client).jobs.get(job_b)["tenant"] == b_id != a_id


def test_cancel_own_job_records_canceled(client: TestClient) -> None:
    t_id, t = _tenant(client, "a")
    job = _job(client, t_id)
    canceled = client.delete(f"/v1/jobs/{job}", headers=t).json()
    assert canceled["state"] == "CANCELED"
    assert [e["state"] for e in canceled["timeline"]] == ["QUEUED", "CANCELED"]


def test_revoked_key_is_401_and_keys_are_stored_hashed(client: TestClient) -> None:
    t_id, t = _tenant(client, "a")
    key = t["Authorization"].split()[1]
    assert client.get("/v1/models", headers=t).status_code == 200
    keys = client.get(f"/admin/tenants/{t_id}/keys", headers=ADMIN).json()
    assert len(keys) == 1 and "key" not in keys[0]  # shown once, at issue
    stored = _services(client).redis
    assert not any(key.encode() in (stored.dump(k) or b"") for k in stored.scan_iter(f"{_prefix(client)}:*"))
    assert client.delete(f"/admin/tenants/{t_id}/keys/{keys[0]['id']}", headers=ADMIN).json()["revoked"]
    revoked = client.get("/v1/models", headers=t)
    assert (revoked.status_code, revoked.json()) == (
        401,
        openai_error("invalid API key", "authentication_error", "invalid_api_key"),
    )
    assert revoked.headers["www-authenticate"] == "Bearer"
    missing = openai_error("missing API key", "authentication_error", "missing_api_key")
    assert client.get("/v1/models").json() == missing
    assert client.get("/v1/models", headers={"Authorization": "Bearer pfk-nope"}).status_code == 401


def test_admin_routes_refuse_tenant_keys(client: TestClient) -> None:
    _t_id, t = _tenant(client, "a")
    for method, path in (("GET", "/admin/tenants"), ("POST", "/admin/tenants"), ("GET", "/admin/regions")):
        response = client.request(method, path, headers=t, json={"name": "x"})
        assert (response.status_code, response.json()) == (403, {"detail": "admin key required"})
    assert client.get("/admin/tenants").status_code == 401


def test_suspended_tenant_is_refused(client: TestClient) -> None:
    t_id, t = _tenant(client, "a")
    assert client.post(f"/admin/tenants/{t_id}/suspend", headers=ADMIN).json()["status"] == "suspended"
    suspended = openai_error("tenant suspended", "permission_error", "tenant_suspended")
    assert client.get("/v1/models", headers=t).json() == suspended


@pytest.mark.parametrize(
    ("body", "status", "message", "code", "param"),
    [
        ({"model": "nope", "prompt": "hi"}, 404, "model not found: 'nope'; this deployment serves 'tiny-llama'",
         "model_not_found", "model"),
        ({"model": "tiny-llama", "prompt": "hi " * 5000}, 400, "prompt too long for the model",
         "context_length_exceeded", "prompt"),
        ({"model": "tiny-llama", "prompt": [999999]}, 400, "prompt token id out of the model's vocabulary",
         "invalid_token_id", "prompt"),
        ({"model": "tiny-llama", "prompt": "hi", "max_tokens": 0}, 400, "invalid request: max_tokens:",
         "invalid_request", "max_tokens"),
        ({"model": "tiny-llama", "prompt": ""}, 400, "invalid request: prompt", "invalid_request", "prompt"),
        ({"model": "tiny-llama", "prompt": "hi", "prfaas": {"placement": "split"}}, 403, "placement requests are",
         "placement_not_allowed", "prfaas.placement"),
    ],
)  # fmt: skip
def test_bad_completion_requests_get_a_stable_4xx(
    client: TestClient, body: dict[str, object], status: int, message: str, code: str, param: str
) -> None:
    _t_id, t = _tenant(client, "a")
    response = client.post("/v1/completions", json=body, headers=t)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"].startswith(message) and (error["code"], error["param"]) == (code, param), error


def test_budget_and_concurrency_refusals(client: TestClient) -> None:
    t_id, t = _tenant(client, "a", concurrency=1, budget_usd=1)
    job = _job(client, t_id)  # holds the one concurrent slot
    busy = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi"}, headers=t)
    assert (busy.status_code, busy.json()) == (
        429,
        openai_error("too many concurrent jobs", "rate_limit_error", "concurrency_limit_exceeded"),
    )
    jobs = _services(client).jobs
    jobs.transition(job, JobState.LOCAL, 1)
    jobs.transition(job, JobState.DONE, 1, cost_usd=2.0)
    broke = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi"}, headers=t)
    assert (broke.status_code, broke.json()) == (
        402,
        openai_error("monthly budget exhausted", "insufficient_quota", "budget_exhausted"),
    )


def test_health_ready_metrics(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    text = client.get("/metrics", headers=ADMIN).text
    assert 'prfaas_api_responses_total{route="/healthz",status="200"} 1.0' in text
    assert 'prfaas_api_responses_total{route="/readyz",status="200"} 1.0' in text


def test_metrics_need_the_admin_key_or_the_metrics_token() -> None:
    """The job histograms are labelled by tenant id: a scrape without either key learns nothing of the tenants
    (401 with the stable `detail` of a missing or an invalid key, as every route outside /v1 answers it)."""
    token = "scraper-token-of-its-own-0123456789abcdef"
    for settings in settings_fixture(metrics_token=token):
        with TestClient(create_app(settings)) as c:
            c.app.state.meter.latency.observe(
                {"tenant": "acme-corp", "placement_chosen": "local", "decode_region": "r1"}, {"e2e": 1.0}
            )  # what the meter observes for a job it bills
            for headers, detail in (
                ({}, "missing API key"),
                ({"Authorization": "Bearer not-the-admin-key"}, "invalid API key"),
                ({"Authorization": f"Bearer {token}x"}, "invalid API key"),
                ({"Authorization": f"Basic {ADMIN_KEY}"}, "missing API key"),
            ):
                refused = c.get("/metrics", headers=headers)
                assert refused.status_code == 401, headers
                assert refused.json() == {"detail": detail}
                assert refused.headers["www-authenticate"] == "Bearer" and "acme-corp" not in refused.text
            for key in (ADMIN_KEY, token):
                scraped = c.get("/metrics", headers={"Authorization": f"Bearer {key}"})
                assert scraped.status_code == 200 and 'tenant="acme-corp"' in scraped.text


def test_a_500_is_counted() -> None:
    """An unhandled error's 500 (rendered by Starlette's outermost ServerErrorMiddleware) is in
    `prfaas_api_responses_total`, which error-rate alerts read."""
    for settings in settings_fixture():
        app = create_app(settings)

        @app.get("/v1/boom")
        def boom() -> None:
            raise RuntimeError("a bug")

        with TestClient(app, raise_server_exceptions=False) as c:
            response = c.get("/v1/boom")
            assert (response.status_code, response.json()["error"]["type"]) == (500, "server_error")
            scraped = c.get("/metrics", headers=ADMIN).text
            assert 'prfaas_api_responses_total{route="/v1/boom",status="500"} 1.0' in scraped


def _prefix(client: TestClient) -> str:
    return _services(client).settings.key_prefix


def test_a_nul_byte_the_database_cannot_hold_is_a_4xx_not_a_500() -> None:
    """PostgreSQL text holds no NUL: an id or name with one, in a path, a query or a body, is refused with a
    4xx (a tenant can reach one of them), never a 500. (SQLite stores it, so this runs on PostgreSQL.)"""
    with postgres_database() as url:
        for settings in settings_fixture(ledger={"url": url}):
            with TestClient(create_app(settings), raise_server_exceptions=False) as c:
                tenant_id, headers = _tenant(c, "alpha")
                answers = {
                    "usage entry": c.get("/v1/usage/jobs/a%00b", headers=headers),
                    "tenant name": c.post("/admin/tenants", json={"name": "a\x00"}, headers=ADMIN),
                    "tenant kv_codec": c.patch(
                        f"/admin/tenants/{tenant_id}", json={"kv_codec": "k\x00"}, headers=ADMIN
                    ),
                    "tenant id": c.patch("/admin/tenants/x%00", json={"rps": 1}, headers=ADMIN),
                    "keys": c.get("/admin/tenants/x%00/keys", headers=ADMIN),
                    "key id": c.delete(f"/admin/tenants/{tenant_id}/keys/x%00", headers=ADMIN),
                    "usage tenant": c.get("/admin/usage", params={"tenant": "a\x00"}, headers=ADMIN),
                }
                assert {what: r.status_code for what, r in answers.items()} == {
                    "usage entry": 400, "tenant name": 422, "tenant kv_codec": 400, "tenant id": 400, "keys": 400,
                    "key id": 400, "usage tenant": 400,
                }  # fmt: skip
                assert answers["usage entry"].json()["error"]["message"] == (
                    "invalid request: a value the database cannot hold"
                )
                assert c.get("/v1/models", headers=headers).status_code == 200  # and the app still serves


def test_a_link_over_the_schedulers_limits_is_refused_naming_its_field(client: TestClient) -> None:
    """PUT /admin/links checks the scheduler's own limits (60,000 ms, 100,000 Gbit/s): a mistyped RTT was
    answered "a link needs two different regions"."""
    link = {"src": "cheap", "dst": "scarce", "rtt_ms": 70_000, "bandwidth_gbps": 1.0}
    reply = client.put("/admin/links", json=link, headers=ADMIN)
    assert (reply.status_code, reply.json()) == (
        422, {"detail": "invalid request: rtt_ms: Input should be less than or equal to 60000"}
    )  # fmt: skip
    reply = client.put("/admin/links", json=link | {"rtt_ms": 5, "bandwidth_gbps": 200_000}, headers=ADMIN)
    assert reply.json() == {"detail": "invalid request: bandwidth_gbps: Input should be less than or equal to 100000"}
    reply = client.put("/admin/links", json=link | {"rtt_ms": 5, "dst": "cheap"}, headers=ADMIN)
    assert (reply.status_code, reply.json()) == (422, {"detail": "a link needs two different regions"})
    assert client.put("/admin/links", json=link | {"rtt_ms": 60_000}, headers=ADMIN).status_code == 200


def test_a_database_pool_run_dry_is_a_503() -> None:
    """Every connection of the pool held by statements a stalled database keeps waiting (db/engine.py bounds
    them): the next lookup times out waiting for one (sqlalchemy's TimeoutError, not an OperationalError), which
    is `database_unavailable` like any database outage, not a 500."""
    for settings in settings_fixture():
        app = create_app(settings)

        @app.get("/v1/lookup")
        def lookup() -> None:
            raise sqlalchemy.exc.TimeoutError("QueuePool limit of size 5 overflow 10 reached, connection timed out")

        with TestClient(app, raise_server_exceptions=False) as c:
            reply = c.get("/v1/lookup")
            assert reply.status_code == 503 and reply.headers["retry-after"] == "2"
            assert reply.json()["error"]["code"] == "database_unavailable"
