"""Dashboard admin sessions and admin-key rotation (the app in-process, on the real Redis): a session signed in
with the admin key ends once the control plane runs with another admin key, as the API refuses the old key
at once. (Before, the old session kept the fleet view for its 8 hours.) Tenant sessions: test_dashboard.py."""

from __future__ import annotations

import re
import uuid

from cp_kit import ADMIN_KEY, cleanup, make_settings
from fastapi.testclient import TestClient

from prfaas.control_plane.app import create_app


def _signed_in(client: TestClient, key: str) -> str:
    form = client.get("/dashboard/login")
    found = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert found is not None
    signed = client.post("/dashboard/login", data={"api_key": key, "csrf": found.group(1)}, follow_redirects=False)
    assert signed.status_code == 303
    token = client.cookies.get("prfaas_session")
    assert token
    return token


def test_an_admin_session_ends_when_the_admin_key_is_rotated() -> None:
    prefix = f"prfaas-test-{uuid.uuid4().hex[:12]}"
    before = make_settings(key_prefix=prefix)
    rotated = make_settings(key_prefix=prefix, ledger=before.ledger, admin_key="rotated-" + uuid.uuid4().hex * 2)
    try:
        with TestClient(create_app(before)) as c:
            token = _signed_in(c, ADMIN_KEY)
            assert "<h1>Fleet</h1>" in c.get("/dashboard").text
        with TestClient(create_app(rotated)) as c:  # restarted with a new key, on the same Redis
            assert c.get("/admin/tenants", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 403
            c.cookies.set("prfaas_session", token, path="/dashboard")
            page = c.get("/dashboard", follow_redirects=False)
            assert (page.status_code, page.headers["location"]) == (303, "/dashboard/login")
            c.cookies.clear()
            c.cookies.set("prfaas_session", token, path="/dashboard")
            assert c.get("/dashboard", follow_redirects=False).status_code == 303  # and the session is gone
            c.cookies.clear()
            _signed_in(c, rotated.admin_key.get_secret_value())
            assert "<h1>Fleet</h1>" in c.get("/dashboard").text  # the new key signs in
    finally:
        cleanup(before)
