"""The dashboard's routes: sign in (an API key or the admin key), sign out, and the page (a tenant's or the
admin's). Pages are Jinja2 templates with the security headers of `HEADERS`."""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.dashboard.data import admin_view, tenant_view
from prfaas.control_plane.dashboard.sessions import CSRF_COOKIE, SESSION_COOKIE, SESSION_TTL_S, SessionStore, same
from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import KEY_PREFIX, KeyNotFound, TenantNotFound, TenantStatus

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(prefix="/dashboard", include_in_schema=False)
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def install(app: FastAPI) -> None:
    app.mount("/dashboard/static", StaticFiles(directory=str(HERE / "static")), name="dashboard-static")
    app.include_router(router)


def _services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


def _admin_key_id(s: Services) -> str:
    """What an admin session keeps of the admin key it signed in with (a keyed digest, not the key): the session
    ends when the control plane's admin key is no longer that one."""
    secret = s.settings.admin_key.get_secret_value().encode()
    return hmac.new(secret, b"prfaas dashboard admin session", "sha256").hexdigest()[:32]


def _sessions(request: Request) -> SessionStore:
    return SessionStore(_services(request).redis, _services(request).settings.key_prefix)


def _page(request: Request, name: str, context: dict[str, Any], status: int = 200) -> HTMLResponse:
    response = templates.TemplateResponse(request, name, context, status_code=status)
    response.headers.update(HEADERS)
    return response


def _to_login() -> RedirectResponse:
    response = RedirectResponse("/dashboard/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/dashboard")
    return response


def _cookie(request: Request, response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name, value, max_age=max_age, path="/dashboard", httponly=True, samesite="strict",
        secure=request.url.scheme == "https",
    )  # fmt: skip


@router.get("/login")
def login_form(request: Request) -> HTMLResponse:
    """The sign-in page. It takes no message from the URL: a link could make it say anything."""
    csrf = secrets.token_urlsafe(32)
    response = _page(request, "login.html", {"csrf": csrf, "error": ""})
    _cookie(request, response, CSRF_COOKIE, csrf, 3600)
    return response


@router.post("/login", response_model=None)
def login(
    request: Request, api_key: Annotated[str, Form(max_length=256)], csrf: Annotated[str, Form(max_length=128)]
) -> Response:
    if not same(csrf, request.cookies.get(CSRF_COOKIE)):
        return _page(request, "login.html", {"csrf": "", "error": "form expired: reload the page"}, 403)
    s = _services(request)
    key = api_key.strip()
    if hmac.compare_digest(key.encode(), s.settings.admin_key.get_secret_value().encode()):
        token, _ = _sessions(request).create("admin", key_id=_admin_key_id(s))
    else:
        tenant = s.tenants.authenticate(key)
        if tenant is None:
            return login_error(request, "invalid API key", 401)
        if tenant.status is TenantStatus.SUSPENDED:
            return login_error(request, "tenant suspended", 403)
        key_id = key.removeprefix(KEY_PREFIX).split("-", 1)[0]
        token, _ = _sessions(request).create("tenant", tenant.id, key_id)
    response = RedirectResponse("/dashboard", status_code=303)
    _cookie(request, response, SESSION_COOKIE, token, SESSION_TTL_S)
    response.delete_cookie(CSRF_COOKIE, path="/dashboard")
    return response


def login_error(request: Request, error: str, status: int) -> HTMLResponse:
    csrf = secrets.token_urlsafe(32)
    response = _page(request, "login.html", {"csrf": csrf, "error": error}, status)
    _cookie(request, response, CSRF_COOKIE, csrf, 3600)
    return response


@router.post("/logout", response_model=None)
def logout(request: Request, csrf: Annotated[str, Form(max_length=128)]) -> Response:
    store = _sessions(request)
    token = request.cookies.get(SESSION_COOKIE)
    session = store.get(token)
    if session is not None and not same(csrf, session.csrf):
        return Response("invalid CSRF token", status_code=403, headers=HEADERS)
    store.delete(token)
    return _to_login()


@router.get("", response_model=None)
def dashboard(request: Request) -> Response:
    session = _sessions(request).get(request.cookies.get(SESSION_COOKIE))
    if session is None:
        return _to_login()
    meter: Meter = request.app.state.meter
    if session.kind == "admin":
        if not same(session.key_id, _admin_key_id(_services(request))):  # signed in with a key since rotated
            _sessions(request).delete(request.cookies.get(SESSION_COOKIE))
            return _to_login()
        return _page(request, "admin.html", {"csrf": session.csrf, "signed_in": True, "v": admin_view(meter)})
    s = _services(request)
    try:
        tenant = s.tenants.get(session.tenant)
        key = s.tenants.get_key(session.key_id)
    except (TenantNotFound, KeyNotFound):
        return _to_login()
    if key.revoked or key.tenant != tenant.id or tenant.status is TenantStatus.SUSPENDED:
        _sessions(request).delete(request.cookies.get(SESSION_COOKIE))
        return _to_login()
    context = {"csrf": session.csrf, "signed_in": True, "tenant": tenant, "v": tenant_view(meter, tenant.id)}
    return _page(request, "tenant.html", context)
