"""TenantStore (issue 29): the database holds tenants and keys, Redis caches them. On the real Redis (a key
prefix of each test's own) and the database in SQLite and in PostgreSQL (a database of the test's own on the
server at 127.0.0.1:5432)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import redis
from cp_kit import cleanup, ensure_redis, make_settings, postgres_database

from prfaas.control_plane.services import Services
from prfaas.control_plane.tenants import (
    KeyNotFound,
    TenantChanges,
    TenantNotFound,
    TenantStatus,
    TenantStore,
    digest,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def services(request: pytest.FixtureRequest) -> Iterator[Services]:
    ensure_redis()
    with contextlib.ExitStack() as stack:
        overrides: dict[str, object] = {}
        if request.param == "postgresql":
            overrides["ledger"] = {"url": stack.enter_context(postgres_database())}
        settings = make_settings(**overrides)
        s = Services.create(settings)
        yield s
        s.close()
        cleanup(settings)


def _empty_redis(s: Services) -> None:
    """What a Redis restarted empty looks like to this deployment: none of its keys."""
    keys = list(s.redis.scan_iter(s.settings.key("*"), count=1000))
    if keys:
        s.redis.delete(*keys)


def test_tenants_and_keys_outlive_redis(services: Services) -> None:
    store = services.tenants
    filled: list[str] = []
    store.on_fill = lambda t: filled.append(t.id)
    acme = store.create("acme", TenantChanges(rps=7.0, concurrency=3, budget_usd=12.5, allow_placement=True))
    key, full = store.issue_key(acme.id)
    assert store.authenticate(full) == acme and filled == [acme.id]  # a miss: read from the database, cached
    assert store.authenticate(full) == acme and filled == [acme.id]  # a hit
    _empty_redis(services)
    assert store.authenticate(full) == acme and filled == [acme.id, acme.id]  # no operator needed
    assert store.get(acme.id).quota.budget_usd == 12.5 and [k.id for k in store.list_keys(acme.id)] == [key.id]
    assert [t.name for t in store.all()] == ["acme"]


def test_a_second_store_on_the_same_database_sees_everything(services: Services) -> None:
    acme = services.tenants.create("acme")
    _, full = services.tenants.issue_key(acme.id)
    other = TenantStore(redis.Redis.from_url(services.settings.redis_url), services.settings, services.database)
    _empty_redis(services)
    assert other.authenticate(full) == acme
    assert other.warm() == 1 and services.redis.exists(services.settings.key("tenant", acme.id))


def test_revocation_suspension_and_updates_reach_the_cache(services: Services) -> None:
    store = services.tenants
    acme = store.create("acme")
    key, full = store.issue_key(acme.id)
    assert store.authenticate(full) == acme
    suspended = store.update(acme.id, TenantChanges(status=TenantStatus.SUSPENDED, rps=1.0))
    assert store.authenticate(full) == suspended and suspended.quota.rps == 1.0  # cached: the new fields at once
    assert store.revoke_key(acme.id, key.id).revoked
    assert store.authenticate(full) is None  # cached refusal
    _empty_redis(services)
    assert store.authenticate(full) is None  # and from the database
    with pytest.raises(KeyNotFound):
        store.revoke_key("t-someone-else", key.id)
    with pytest.raises(TenantNotFound):
        store.issue_key("t-nobody")
    with pytest.raises(TenantNotFound):
        store.update("t-nobody", TenantChanges(rps=1.0))


@pytest.mark.parametrize("write", ["revoke", "suspend"])
def test_a_write_between_a_fills_read_and_its_cache_write_is_kept(services: Services, write: str) -> None:
    """A request fills the cache from the database; the operator's revoke or suspension commits and is
    written through after that read but before the fill's cache write. The fill must not put its older
    answer over it (the revoked key or suspended tenant would be served for the cache's TTL)."""
    store = services.tenants
    acme = store.create("acme")
    key, full = store.issue_key(acme.id)
    _empty_redis(services)  # the next authenticate misses and reads the database
    fill = store.cache.fill

    def operator_writes_first(tenant: object, digests: object = ()) -> None:
        if write == "revoke":
            store.revoke_key(acme.id, key.id)
        else:
            store.update(acme.id, TenantChanges(status=TenantStatus.SUSPENDED))
        fill(tenant, digests)  # type: ignore[arg-type]

    store.cache.fill = operator_writes_first  # type: ignore[method-assign]
    assert store.authenticate(full) == acme  # this request read the database before the write
    store.cache.fill = fill  # type: ignore[method-assign]
    later = store.authenticate(full)
    if write == "revoke":
        assert later is None
    else:
        assert later is not None and later.status is TenantStatus.SUSPENDED


def test_unknown_and_malformed_keys(services: Services) -> None:
    store = services.tenants
    assert store.authenticate("not-a-key") is None
    assert store.authenticate("pfk-" + "x" * 200) is None
    unknown = "pfk-000000000000-" + "y" * 32
    assert store.authenticate(unknown) is None
    assert 0 < services.redis.ttl(services.settings.key("keyhash", digest(unknown))) <= 5  # refused a while


def test_redis_down_is_a_redis_error_not_a_wrong_answer(services: Services) -> None:
    acme = services.tenants.create("acme")
    _, full = services.tenants.issue_key(acme.id)
    down = make_settings(redis_url="redis://127.0.0.1:1/0", ledger={"url": services.settings.ledger.url})
    store = TenantStore(redis.Redis.from_url(down.redis_url, socket_connect_timeout=1), down, services.database)
    with pytest.raises(redis.ConnectionError):
        store.authenticate(full)
    assert store.update(acme.id, TenantChanges(rps=2.0)).quota.rps == 2.0  # the database has it; cache ages out


def test_the_admin_view_names_every_tenant_the_ledger_bills_after_redis_is_emptied(services: Services) -> None:
    from prfaas.control_plane.billing.costs import JobUsage, PriceTable
    from prfaas.control_plane.billing.meter import open_meter
    from prfaas.control_plane.dashboard.data import admin_view

    acme = services.tenants.create("acme")
    meter = open_meter(services)
    prices = PriceTable({"r": 1.0}, {})
    usage = JobUsage(job_id="j1", tenant=acme.id, model="tiny-llama", prefill_region="r", decode_region="r",
                     prefill_gpu_s=1.0, decode_gpu_s=1.0, tokens_in=10, tokens_out=2)  # fmt: skip
    meter.ledger.record(usage, prices)
    _empty_redis(services)
    assert [(t["id"], t["name"]) for t in admin_view(meter)["tenants"]] == [(acme.id, "acme")]


def test_warm_raises_each_tenants_spend_before_caching_it(services: Services) -> None:
    """Redis restarted empty, then an API starts: `warm` caches every tenant, so no request's fill syncs its
    spend; warm runs `on_fill` (app.py's spend sync) itself, and the month's spend billed already still counts."""
    from prfaas.control_plane.billing.costs import JobUsage, PriceTable
    from prfaas.control_plane.billing.meter import open_meter
    from prfaas.control_plane.jobs.errors import AdmissionRefused

    store = services.tenants
    meter = open_meter(services)
    store.on_fill = lambda t: meter.spend.sync(t.id, meter.ledger)  # what app.py installs before warm
    acme = store.create("acme", TenantChanges(budget_usd=2.0))
    _, full = store.issue_key(acme.id)
    usage = JobUsage(job_id="j1", tenant=acme.id, model="tiny-llama", prefill_region="r", decode_region="r",
                     prefill_gpu_s=3600.0, decode_gpu_s=3600.0, tokens_in=10, tokens_out=2)  # fmt: skip
    assert meter.ledger.record(usage, PriceTable({"r": 1.0}, {})).total_usd == 2.0  # the month's budget, spent
    _empty_redis(services)
    assert store.warm() == 1
    tenant = store.authenticate(full)  # a cache hit: no fill
    assert tenant == acme and services.jobs.spend(acme.id) == 2.0
    with pytest.raises(AdmissionRefused, match="budget"):
        services.jobs.admit(acme.id, tenant.quota)


def test_request_objective_defaults_round_trip_through_database_and_cache(services: Services) -> None:
    store = services.tenants
    tenant = store.create("slo", TenantChanges(ttft_slo_ms=1500.0, kv_codec="int8"))
    _, key = store.issue_key(tenant.id)
    assert (tenant.objectives.ttft_slo_ms, tenant.objectives.tpot_slo_ms, tenant.objectives.kv_codec) == (
        1500.0, None, "int8",
    )  # fmt: skip
    cached = store.authenticate(key)  # from the database, then cached
    assert cached is not None and cached.objectives == tenant.objectives
    again = store.authenticate(key)  # from the cache
    assert again is not None and again.objectives == tenant.objectives
    changed = store.update(tenant.id, TenantChanges(tpot_slo_ms=80.0, kv_codec="lossless"))
    assert changed.objectives.tpot_slo_ms == 80.0 and changed.objectives.ttft_slo_ms == 1500.0
    _empty_redis(services)
    fresh = store.authenticate(key)
    assert fresh is not None and fresh.objectives.kv_codec == "lossless" and fresh.objectives.tpot_slo_ms == 80.0
