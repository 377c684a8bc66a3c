"""The usage ledger (control_plane/billing/) against SQLite (a tmp file) and the real local PostgreSQL
(a schema of its own per test, dropped after): exactly-once entries, also from racing threads, sums
recomputed from GPU-seconds x prices, group-by queries, wasted attempts, Alembic from empty to head."""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from prfaas.control_plane.billing.costs import JobUsage, PriceTable
from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.control_plane.db.engine import make_engine
from prfaas.control_plane.db.migrations import current, upgrade
from prfaas.control_plane.settings import Settings

PRICES = PriceTable(
    gpu_hour_usd={"us-east": 4.0, "eu-west": 2.5, "ap-south": 1.2},
    egress_usd_per_gb={("ap-south", "us-east"): 0.09, ("eu-west", "us-east"): 0.02},
)
T0 = dt.datetime(2026, 11, 1, 12, 0, tzinfo=dt.UTC)


def _usage(job_id: str, **kw: object) -> JobUsage:
    base: dict[str, object] = {
        "job_id": job_id,
        "tenant": "acme",
        "model": "tiny-llama",
        "prefill_region": "ap-south",
        "decode_region": "us-east",
        "prefill_gpu_s": 36.0,
        "decode_gpu_s": 18.0,
        "tokens_in": 1000,
        "tokens_out": 50,
        "kv_bytes_raw": 4_000_000_000,
        "kv_bytes_wire": 2_000_000_000,
        "finished_at": T0,
    }
    base.update(kw)
    return JobUsage(**base)  # type: ignore[arg-type]


def test_migration_empty_to_head_and_idempotent(db: tuple[str, str | None]) -> None:
    url, schema = db
    eng = make_engine(url, schema)
    try:
        assert current(eng) is None
        assert not sa.inspect(eng).has_table("ledger_usage")
        upgrade(url, engine=eng)
        assert current(eng) == "0006_links"
        assert {"ledger_usage", "ledger_wasted", "alembic_version"} <= set(sa.inspect(eng).get_table_names())
        upgrade(url, engine=eng)  # at head already: a no-op
        assert current(eng) == "0006_links"
        Ledger(url, schema=schema).close()  # startup upgrade on a migrated database
        assert current(eng) == "0006_links"
    finally:
        eng.dispose()


def test_models_match_migration(ledger: Ledger) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from prfaas.control_plane.db.migrations import target_metadata

    with ledger.engine.connect() as c:
        diffs = compare_metadata(MigrationContext.configure(c), target_metadata())
    assert diffs == []


def test_record_once_and_costs(ledger: Ledger) -> None:
    e = ledger.record(_usage("j1"), PRICES)
    assert e.prefill_usd == pytest.approx(36 / 3600 * 1.2)
    assert e.decode_usd == pytest.approx(18 / 3600 * 4.0)
    assert e.egress_usd == pytest.approx(2.0 * 0.09)
    assert e.total_usd == pytest.approx(e.prefill_usd + e.decode_usd + e.egress_usd)
    assert e.colocated_usd == pytest.approx((36 + 18) / 3600 * 4.0)
    assert e.savings_usd == pytest.approx(e.colocated_usd - e.total_usd)
    # A retry with different numbers and other prices: the stored entry, unchanged.
    other = PriceTable({"ap-south": 9, "us-east": 9}, {("ap-south", "us-east"): 1.0})
    again = ledger.record(_usage("j1", decode_gpu_s=999.0, tokens_out=7), other)
    assert (again.id, again.decode_gpu_s, again.tokens_out, again.total_usd) == (e.id, 18.0, 50, e.total_usd)
    with ledger.engine.connect() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(UsageEntry)).scalar_one() == 1
    # The unique constraint holds without the Python path.
    with pytest.raises(IntegrityError), ledger.session() as s:
        s.add(UsageEntry(**{k: getattr(e, k) for k in UsageEntry.__table__.columns.keys() if k != "id"}))  # noqa: SIM118
    local = ledger.record(_usage("j2", prefill_region="us-east", kv_bytes_wire=0), PRICES)
    assert local.egress_usd == 0.0 and local.savings_usd == pytest.approx(0.0)
    with pytest.raises(KeyError, match="no egress"):
        ledger.record(_usage("j3", prefill_region="us-east", decode_region="ap-south"), PRICES)
    assert ledger.entry("j3") is None


def test_record_many_writes_each_new_job_once_in_one_batch(ledger: Ledger) -> None:
    first = ledger.record(_usage("b1"), PRICES)
    batch = [(_usage("b1", decode_gpu_s=999.0), PRICES), (_usage("b2"), PRICES), (_usage("b2", tokens_out=7), PRICES),
             (_usage("b3", prefill_region="us-east", kv_bytes_wire=0), PRICES)]  # fmt: skip
    results = ledger.record_many(batch)
    # b1 was billed before: its stored entry, not written; b2's second copy: the first copy's entry, not written
    assert [(e.job_id, written) for e, written in results] == [("b1", False), ("b2", True), ("b2", False),
                                                               ("b3", True)]  # fmt: skip
    assert results[0][0].id == first.id and results[0][0].decode_gpu_s == first.decode_gpu_s
    assert results[1][0].id == results[2][0].id and results[2][0].tokens_out == 50
    assert results[3][0].egress_usd == 0.0
    # each entry as `record` computes it alone
    alone = ledger.record(_usage("b4"), PRICES)
    assert results[1][0].total_usd == pytest.approx(alone.total_usd)
    with ledger.engine.connect() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(UsageEntry)).scalar_one() == 4
    assert ledger.record_many([]) == []


def test_concurrent_writers_one_row(ledger: Ledger) -> None:
    n = 8
    barrier = threading.Barrier(n)
    ids: list[int] = []
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            barrier.wait()
            ids.append(ledger.record(_usage("race", tokens_out=i), PRICES).id)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(ids) == n and len(set(ids)) == 1
    with ledger.engine.connect() as c:
        rows = c.execute(sa.select(UsageEntry.tokens_out).where(UsageEntry.job_id == "race")).all()
    assert len(rows) == 1


def test_group_by_and_recomputed_sums(ledger: Ledger) -> None:
    jobs = [
        _usage("a", finished_at=T0),
        _usage("b", finished_at=T0 + dt.timedelta(hours=11), model="smollm2-135m", prefill_region="eu-west"),
        _usage("c", finished_at=T0 + dt.timedelta(days=1), prefill_region="us-east", kv_bytes_wire=0),
        _usage("d", finished_at=T0 + dt.timedelta(days=5)),  # outside the window
        _usage("e", finished_at=T0, tenant="other"),  # another tenant
    ]
    for j in jobs:
        ledger.record(j, PRICES)
    start, end = T0 - dt.timedelta(hours=1), T0 + dt.timedelta(days=2)
    mine = [j for j in jobs if j.job_id in "abc"]

    def cost(j: JobUsage) -> float:
        p, d = PRICES.gpu_hour(j.prefill_region), PRICES.gpu_hour(j.decode_region)
        eg = PRICES.egress(j.prefill_region, j.decode_region)
        return j.prefill_gpu_s / 3600 * p + j.decode_gpu_s / 3600 * d + j.kv_bytes_wire / 1e9 * eg

    by_day = {g.key: g for g in ledger.totals("acme", start, end, "day")}
    assert set(by_day) == {"2026-11-01", "2026-11-02"}
    assert by_day["2026-11-01"].jobs == 2 and by_day["2026-11-02"].jobs == 1
    assert sum(g.total_usd for g in by_day.values()) == pytest.approx(sum(cost(j) for j in mine))
    assert by_day["2026-11-02"].total_usd == pytest.approx(cost(mine[2]))
    assert sum(g.tokens_in for g in by_day.values()) == 3000

    by_model = {g.key: g for g in ledger.totals("acme", start, end, "model")}
    assert by_model["smollm2-135m"].jobs == 1 and by_model["tiny-llama"].jobs == 2
    assert by_model["smollm2-135m"].total_usd == pytest.approx(cost(mine[1]))
    colo = sum((j.prefill_gpu_s + j.decode_gpu_s) / 3600 * 4.0 for j in mine)
    assert sum(g.savings_usd for g in by_model.values()) == pytest.approx(colo - sum(cost(j) for j in mine))

    by_region = {g.key: g for g in ledger.totals("acme", start, end, "region")}
    assert set(by_region) == {"ap-south", "eu-west", "us-east"}
    assert by_region["ap-south"].prefill_usd == pytest.approx(36 / 3600 * 1.2)
    assert by_region["ap-south"].egress_usd == pytest.approx(2 * 0.09)
    assert by_region["us-east"].decode_usd == pytest.approx(3 * 18 / 3600 * 4.0)
    assert by_region["us-east"].jobs == 3  # c prefilled and decoded there: counted once
    assert sum(g.total_usd for g in by_region.values()) == pytest.approx(sum(cost(j) for j in mine))
    assert ledger.totals("nobody", start, end, "day") == []


def test_wasted_attempts_are_platform_cost(ledger: Ledger) -> None:
    w1 = ledger.record_wasted(
        job_id="j", attempt=1, phase="prefill", tenant="acme", region="ap-south", gpu_s=72.0, prices=PRICES,
        reason="region lost", recorded_at=T0,
    )  # fmt: skip
    ledger.record_wasted(
        job_id="j", attempt=2, phase="prefill", tenant="acme", region="eu-west", gpu_s=36.0, prices=PRICES,
        recorded_at=T0,
    )  # fmt: skip
    dup = ledger.record_wasted(
        job_id="j", attempt=1, phase="prefill", tenant="acme", region="ap-south", gpu_s=1.0, prices=PRICES
    )
    assert dup.id == w1.id and dup.gpu_s == 72.0
    assert [w.attempt for w in ledger.wasted("j")] == [1, 2]
    assert w1.cost_usd == pytest.approx(72 / 3600 * 1.2)
    ledger.record(_usage("j", prefill_region="us-east", kv_bytes_wire=0), PRICES)
    assert ledger.platform_cost(T0, T0 + dt.timedelta(days=1)) == pytest.approx(72 / 3600 * 1.2 + 36 / 3600 * 2.5)
    # The tenant is billed only for the attempt that answered.
    (day,) = ledger.totals("acme", T0, T0 + dt.timedelta(days=1), "day")
    assert day.total_usd == pytest.approx((36 + 18) / 3600 * 4.0)


def test_default_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def url() -> str:
        return Settings(dev=True, admin_key="a", ticket_key="t").ledger.url  # type: ignore[arg-type]

    monkeypatch.setenv("PRFAAS_HOME", str(tmp_path))
    monkeypatch.delenv("PRFAAS_LEDGER_URL", raising=False)
    assert url() == f"sqlite:///{tmp_path / 'ledger.db'}"
    led = Ledger(url())
    led.record(_usage("x"), PRICES)
    led.close()
    assert (tmp_path / "ledger.db").exists()
    monkeypatch.setenv("PRFAAS_LEDGER_URL", "sqlite:///" + str(tmp_path / "other.db"))
    assert url().endswith("other.db")


def test_phase_and_tenant_groupings_entries_and_spend(ledger: Ledger) -> None:
    split = _usage("s", placement="split", ttft_s=0.5)
    local = _usage("l", prefill_region="us-east", kv_bytes_wire=0, kv_bytes_raw=0, placement="local")
    other = _usage("o", tenant="other", finished_at=T0 + dt.timedelta(hours=1))
    for j in (split, local, other):
        ledger.record(j, PRICES)
    start, end = T0 - dt.timedelta(hours=1), T0 + dt.timedelta(days=1)
    phases = {g.key: g for g in ledger.totals("acme", start, end, "phase")}
    assert list(phases) == ["prefill", "decode", "egress"]
    # prefill: 36 s at ap-south's 1.2 (split) + 36 s at us-east's 4.0 (local, prefilled in the decode region)
    assert phases["prefill"].total_usd == pytest.approx(36 / 3600 * 1.2 + 36 / 3600 * 4.0)
    assert phases["decode"].total_usd == pytest.approx(2 * 18 / 3600 * 4.0)
    assert (phases["egress"].jobs, phases["egress"].total_usd) == (1, pytest.approx(2.0 * 0.09))
    assert phases["egress"].kv_bytes_wire == 2_000_000_000 and phases["prefill"].prefill_gpu_s == 72.0
    by_day = ledger.totals("acme", start, end, "day")
    assert sum(g.total_usd for g in phases.values()) == pytest.approx(sum(g.total_usd for g in by_day))
    assert sum(g.colocated_usd for g in phases.values()) == pytest.approx(sum(g.colocated_usd for g in by_day))
    tenants = {g.key: g.jobs for g in ledger.totals(None, start, end, "tenant")}
    assert tenants == {"acme": 2, "other": 1}
    # newest first; s and l share a finish time: the later insert first
    assert [e.job_id for e in ledger.entries(None, start, end)] == ["o", "l", "s"]
    assert {e.job_id for e in ledger.entries("acme", start, end)} == {"s", "l"}
    assert ledger.entry("s").placement == "split" and ledger.entry("s").ttft_s == 0.5  # type: ignore[union-attr]
    assert ledger.spend("acme", start, end) == pytest.approx(sum(g.total_usd for g in by_day))
    assert ledger.totals("nobody", start, end, "phase") == []
