"""One metered control plane for the metering tests (test_usage_e2e.py, test_dashboard.py share it: a
session-scoped fixture): real API, Celery worker, a prefill and a decode region (tiny-llama), real Redis, the
ledger in a SQLite file, prices from a configuration table that differs from the regions' registered prices
(so a bill at the table's price shows where prices come from). Tenants A and B run split and local jobs
through the official openai client before the tests look at the ledger."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import yaml
from cp_kit import ensure_redis

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.devstack.stack import ADMIN, Stack, wait_until
from prfaas.engine.hf import HFEngine
from prfaas.engine.models import prepare_model

# $/GPU-hour in the price table; the regions register 0.5 and 4.0 (what the scheduler used before prices)
PRICES = {"prefill-a": {"usd_per_gpu_hour": 1.2, "spot_usd_per_gpu_hour": 0.6}, "decode-b": {"usd_per_gpu_hour": 3.5}}
EGRESS_USD_PER_GB = 0.09
SPLIT_TOKENS = 600  # above the stack's split threshold (200 uncached tokens)


@dataclass
class Metered:
    stack: Stack
    keys: dict[str, str]  # tenant name -> API key
    ids: dict[str, str]  # tenant name -> tenant id
    jobs: dict[str, list[str]] = field(default_factory=dict)  # tenant name -> job ids it ran

    def ledger(self) -> Ledger:
        return Ledger(self.stack.ledger_url, migrate=False)

    def entries(self) -> list[UsageEntry]:
        led = self.ledger()
        try:
            import datetime as dt

            far = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)
            return led.entries(None, dt.datetime(2000, 1, 1, tzinfo=dt.UTC), far)
        finally:
            led.close()

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


def run_jobs(m: Metered, tenant: str, prompts: list[tuple[list[int], str]], max_tokens: int = 6) -> None:
    """Each (prompt, placement asked: auto / split / local) through the official client, one after another."""
    client = openai.OpenAI(base_url=m.stack.url + "/v1", api_key=m.keys[tenant], max_retries=0, timeout=60)
    for prompt, placement in prompts:
        reply = client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=max_tokens, extra_body={"prfaas": {"placement": placement}}
        )
        m.jobs.setdefault(tenant, []).append(reply.id)


def wait_billed(m: Metered, timeout_s: float = 20.0) -> None:
    """Until every job run so far has its ledger entry (the API bills in the background)."""
    expected = {j for ids in m.jobs.values() for j in ids}
    wait_until(lambda: expected <= {e.job_id for e in m.entries()}, timeout_s, 0.1)


@pytest.fixture(scope="session", name="metered")
def metered_fixture(tmp_path_factory: pytest.TempPathFactory, long_text: str) -> Iterator[Metered]:
    ensure_redis()
    prepare_model("tiny-llama")
    folder = tmp_path_factory.mktemp("metered")
    prices = folder / "prices.yaml"
    prices.write_text(yaml.safe_dump({"max_age_s": 3600, "refresh_s": 3600, "regions": PRICES}))
    # dispatch visibility 30 s: a cold first prefill (> the stack's 3 s) is not redelivered to a second thread
    s = Stack(folder, PRFAAS_PRICES_PATH=str(prices), PRFAAS_DISPATCH_VISIBILITY_S="30")
    try:
        s.start_api()
        s.start_worker("w1")
        s.region("prefill-a", "prefill", 0.5)
        s.region("decode-b", "decode", 4.0)
        link = {"src": "prefill-a", "dst": "decode-b", "rtt_ms": 1.0, "bandwidth_gbps": 10.0}
        link["egress_usd_per_gb"] = EGRESS_USD_PER_GB
        httpx.put(s.url + "/admin/links", json=link, headers=ADMIN, timeout=5).raise_for_status()
        wait_until(lambda: len(s.healthy()) == 2, 30, 0.1)
        ids, keys = {}, {}
        for name in ("alpha", "beta"):
            ids[name], keys[name] = s.tenant(name, allow_placement=True)
        m = Metered(s, keys, ids)
        ids_of = HFEngine("tiny-llama").encode(long_text)
        long_a = [ids_of[i * 50 : i * 50 + SPLIT_TOKENS] for i in range(2)]
        # one split asked per tenant (so there is egress to bill whatever the scheduler picks for the rest)
        run_jobs(m, "alpha", [(long_a[0], "split"), (long_a[1], "auto"), ([5, 6, 7, 8], "auto"), ([9, 10, 11], "auto")])
        run_jobs(m, "beta", [(ids_of[700 : 700 + SPLIT_TOKENS], "split"), ([12, 13, 14, 15, 16], "auto")])
        wait_billed(m)
        yield m
    finally:
        s.stop()
        s.cleanup()
