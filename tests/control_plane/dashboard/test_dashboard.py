"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright; no browser is
downloaded) against metering_kit's stack of real processes: sign in with an API key, the charts have data
points, tenant A's page shows none of tenant B's jobs or spend, signing out ends the session (a copied cookie is
dead too), CSRF-less forms are refused, every request stays on the control plane (no internet), the admin fleet
view. Screenshots go to the test's temporary folder, and to $PRFAAS_SCREENSHOT_DIR when set."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from metering_kit import Metered

from prfaas.devstack.stack import ADMIN_KEY

pytestmark = pytest.mark.e2e
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def _save(page: Any, shots: Path, name: str) -> None:
    path = shots / name
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    extra = os.environ.get("PRFAAS_SCREENSHOT_DIR")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / name)


def _sign_in(context: Any, m: Metered, key: str, seen: list[str]) -> Any:
    page = context.new_page()
    page.on("request", lambda r: seen.append(r.url))
    page.goto(m.stack.url + "/dashboard")
    assert page.url.endswith("/dashboard/login")
    page.fill("#api-key", key)
    page.click("#sign-in")
    page.wait_for_url(m.stack.url + "/dashboard")
    return page


def _points(page: Any, chart: str) -> list[float]:
    """Every value of every dataset of the Chart.js chart drawn on canvas #chart-{chart}."""
    return list(page.evaluate("(id) => Chart.getChart(id).data.datasets.flatMap(d => d.data)", f"chart-{chart}"))


def test_tenant_signs_in_sees_own_charts_and_jobs_only(browser: Any, metered: Metered, shots: Path) -> None:
    m = metered
    entries = m.entries()
    seen: list[str] = []
    views = {}
    for name in ("alpha", "beta"):
        context = browser.new_context()
        page = _sign_in(context, m, m.keys[name], seen)
        assert page.text_content("#tenant-name") == name
        for chart in ("spend_phase", "spend_region", "savings"):
            assert sum(1 for v in _points(page, chart) if v > 0) > 0, chart
        shown = set(page.eval_on_selector_all("tr.job", "rows => rows.map(r => r.dataset.jobId)"))
        views[name] = (shown, page.content(), page.text_content("#kpi-spend"))
        if name == "alpha":
            labels = page.evaluate("() => Chart.getChart('chart-spend_region').data.labels")
            assert set(labels) == {"prefill-a", "decode-b"}
            _save(page, shots, "dashboard-tenant.png")
        context.close()
    for name, other in (("alpha", "beta"), ("beta", "alpha")):
        shown, html, spend = views[name]
        mine = {e.job_id for e in entries if e.tenant == m.ids[name]}
        assert shown == mine and shown
        assert not any(job_id in html for job_id in m.jobs[other])  # none of the other tenant's jobs
        own_spend = sum(e.total_usd for e in entries if e.tenant == m.ids[name])
        assert spend == f"${own_spend:.6f}"  # the tenant's own spend, not the fleet's
    assert all(url.startswith(m.stack.url + "/") for url in seen), [u for u in seen if m.stack.url not in u]


def test_sign_out_ends_the_session(browser: Any, metered: Metered) -> None:
    m = metered
    context = browser.new_context()
    page = _sign_in(context, m, m.keys["alpha"], [])
    cookies = context.cookies()
    assert any(c["name"] == "prfaas_session" and c["httpOnly"] and c["sameSite"] == "Strict" for c in cookies)
    page.click("#sign-out")
    page.wait_for_url(m.stack.url + "/dashboard/login")
    page.goto(m.stack.url + "/dashboard")
    assert page.url.endswith("/dashboard/login")
    context.close()
    replay = browser.new_context()  # the cookie from before the sign-out, copied into a fresh browser
    replay.add_cookies(cookies)
    page = replay.new_page()
    page.goto(m.stack.url + "/dashboard")
    assert page.url.endswith("/dashboard/login")
    replay.close()


def test_forms_without_csrf_token_and_bad_keys_are_refused(browser: Any, metered: Metered) -> None:
    m = metered
    url = m.stack.url + "/dashboard"
    forged = httpx.post(url + "/login", data={"api_key": m.keys["alpha"], "csrf": "x"}, timeout=5)
    assert forged.status_code == 403 and "prfaas_session" not in forged.headers.get("set-cookie", "")
    context = browser.new_context()
    page = context.new_page()
    page.goto(url + "/login")
    page.fill("#api-key", "pfk-000000000000-not-a-real-key")
    page.click("#sign-in")
    assert page.text_content("#error") == "invalid API key"
    page = _sign_in(context, m, m.keys["beta"], [])
    cookie = next(c["value"] for c in context.cookies() if c["name"] == "prfaas_session")
    cross = httpx.post(url + "/logout", data={"csrf": "forged"}, cookies={"prfaas_session": cookie}, timeout=5)
    assert cross.status_code == 403
    page.goto(url)
    assert page.url == url  # still signed in: the forged sign-out did nothing
    assert page.evaluate("() => Chart.getChart('chart-spend_phase') !== undefined")
    login = httpx.get(url + "/login", params={"error": "Your account is locked: call +1 555 0100"}, timeout=5)
    assert "call +1 555" not in login.text  # the sign-in page says nothing a link puts in its URL
    headers = login.headers
    assert "script-src 'self'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    context.close()


def test_admin_fleet_view(browser: Any, metered: Metered, shots: Path) -> None:
    m = metered
    context = browser.new_context()
    page = _sign_in(context, m, ADMIN_KEY, [])
    assert page.text_content("#admin") == "admin"
    regions = page.eval_on_selector_all("#regions tbody tr", "rows => rows.map(r => r.cells[0].textContent)")
    assert set(regions) >= {"prefill-a", "decode-b"}
    assert sum(1 for v in _points(page, "tenant_spend") if v > 0) >= 2
    prices = page.eval_on_selector_all("#prices tbody tr", "rows => rows.map(r => r.cells[3].textContent)")
    assert prices and set(prices) == {"table"}
    links = page.text_content("#links")
    assert links is not None and "prefill-a → decode-b" in links
    _save(page, shots, "dashboard-admin.png")
    context.close()
