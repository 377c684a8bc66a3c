"""The control plane's settings keep their environment names: a flat field `name` is `PRFAAS_NAME`, a section's
field `section.name` is `PRFAAS_SECTION_NAME` (split at the first `_` only), and the README lists them all."""

from __future__ import annotations

import secrets
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from prfaas.control_plane.settings import Settings

README = Path(__file__).resolve().parents[2] / "control_plane" / "README.md"
KEYS = {"PRFAAS_ADMIN_KEY": secrets.token_urlsafe(32), "PRFAAS_TICKET_KEY": secrets.token_urlsafe(32)}


def from_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> Settings:
    for name, value in (KEYS | env).items():
        monkeypatch.setenv(name, value)
    return Settings()  # type: ignore[call-arg]


def section_of(annotation: object) -> type[BaseModel] | None:
    """The section model a field holds (`TlsFiles | None` holds `TlsFiles`), or None for a flat field."""
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)


def env_names() -> list[str]:
    names = []
    for name, field in Settings.model_fields.items():
        section = section_of(field.annotation)
        inner = [f"{name}_{sub}" for sub in section.model_fields] if section else [name]
        names += [f"PRFAAS_{n.upper()}" for n in inner]
    return names


@pytest.mark.parametrize(
    ("env", "value", "path", "expected"),
    [
        ("PRFAAS_DEFAULT_RPS", "7", "default.rps", 7.0),
        ("PRFAAS_DEFAULT_CONCURRENCY", "3", "default.concurrency", 3),
        ("PRFAAS_DEFAULT_BUDGET_USD", "12.5", "default.budget_usd", 12.5),  # `budget_usd` whole: one split only
        ("PRFAAS_DEFAULT_MAX_TOKENS", "32", "default.max_tokens", 32),
        ("PRFAAS_DEFAULT_TEMPERATURE", "1", "default.temperature", 1.0),
        ("PRFAAS_DISPATCH_VISIBILITY_S", "5", "dispatch.visibility_s", 5),
        ("PRFAAS_DISPATCH_TIMEOUT_S", "90", "dispatch.timeout_s", 90.0),
        ("PRFAAS_LEASE_FLOOR_S", "10", "lease.floor_s", 10.0),
        ("PRFAAS_LEASE_FACTOR", "2.5", "lease.factor", 2.5),
        ("PRFAAS_JOB_TTL_S", "60", "job.ttl_s", 60),
        ("PRFAAS_JOB_TIMEOUT_S", "3", "job.timeout_s", 3.0),
        ("PRFAAS_ADMISSION_HOLD_S", "0.5", "admission.hold_s", 0.5),
        ("PRFAAS_ADMISSION_PLACEMENT", "false", "admission.placement", False),
        ("PRFAAS_TENANT_CACHE_TTL_S", "9", "tenant_cache_ttl_s", 9.0),  # flat: no `tenant` section
        ("PRFAAS_MAX_NEW_TOKENS_LIMIT", "100", "max_new_tokens_limit", 100),  # flat: no `max` section
    ],
)
def test_an_env_name_sets_its_field(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, path: str, expected: object
) -> None:
    settings: object = from_env(monkeypatch, **{env: value})
    for part in path.split("."):
        settings = getattr(settings, part)
    assert settings == expected


def test_a_section_set_in_part_keeps_its_other_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = from_env(monkeypatch, PRFAAS_DEFAULT_RPS="7", PRFAAS_JOB_TIMEOUT_S="3")
    assert (settings.default.rps, settings.default.concurrency, settings.default.temperature) == (7.0, 16, 0.0)
    assert (settings.job.timeout_s, settings.job.ttl_s) == (3.0, 7 * 86400)


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("PRFAAS_DEFAULT_RPS", "0"),  # gt=0
        ("PRFAAS_DEFAULT_TEMPERATURE", "2.5"),  # le=2
        ("PRFAAS_LEASE_FACTOR", "0.5"),  # ge=1: a lease is never shorter than the prediction
        ("PRFAAS_DISPATCH_VISIBILITY_S", "0"),  # ge=1
        ("PRFAAS_JOB_TTL_S", "0"),  # ge=1
        ("PRFAAS_ADMISSION_HOLD_S", "0"),  # gt=0
    ],
)
def test_a_section_field_out_of_range_is_refused(monkeypatch: pytest.MonkeyPatch, env: str, value: str) -> None:
    with pytest.raises(ValidationError, match=env.removeprefix("PRFAAS_").lower().replace("_", ".", 1)):
        from_env(monkeypatch, **{env: value})


def test_no_flat_field_starts_with_a_section_name() -> None:
    """`PRFAAS_JOB_X` is read as `job.x`: a flat `job_x` beside a `job` section would be shadowed by it."""
    fields = Settings.model_fields
    sections = {name for name, field in fields.items() if section_of(field.annotation)}
    flat = {name for name in fields if name not in sections}
    assert {name for name in flat if name.split("_")[0] in sections} == set()


def test_the_readme_lists_every_env_name() -> None:
    text = README.read_text()
    assert [name for name in env_names() if f"`{name}`" not in text] == []


@pytest.mark.parametrize(
    ("listen", "insecure", "served"),
    [("127.0.0.1:7000", "", True), ("[::1]:7000", "", True), ("localhost:7000", "", True),
     ("0.0.0.0:7000", "", False), ("10.0.0.5:7000", "", False), ("0.0.0.0:7000", "true", True)],
)  # fmt: skip
def test_a_plaintext_registry_off_loopback_needs_registry_insecure(
    monkeypatch: pytest.MonkeyPatch, listen: str, insecure: str, served: bool
) -> None:
    """Without tls, anyone who reaches the registry can register as a region and take over its endpoints: off
    loopback that must be asked for, as a region's `insecure: true`."""
    env = {"PRFAAS_REGISTRY_LISTEN": listen} | ({"PRFAAS_REGISTRY_INSECURE": insecure} if insecure else {})
    if served:
        assert from_env(monkeypatch, **env).registry_listen == listen
    else:
        with pytest.raises(ValidationError, match="registry_insecure"):
            from_env(monkeypatch, **env)
