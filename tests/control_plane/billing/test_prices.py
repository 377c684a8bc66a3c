"""Price feeds through boto3: EC2 spot price history against moto's server mode on loopback (a real
`moto_server` process), on-demand from the Price List API against responses served on loopback (a small HTTP
server replaying two files: botocore's own recorded GetProducts example, and a fixture in that format for
p4d.24xlarge, labelled as such in tests/control_plane/billing/data/). The cache in the real Redis, stale prices flagged,
AWS errors falling back to the table with a logged warning, the scheduler's snapshot reading the prices, and
the Celery beat task refreshing them in a real worker process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import botocore
import httpx
import pytest
import redis
import yaml
from cp_kit import settings_fixture

from prfaas.control_plane.billing.price_feeds import PriceFeed
from prfaas.control_plane.billing.prices import PriceBook, PriceConfig
from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.settings import AwsSection, PricesSection, PricingSection, Settings
from prfaas.devstack.stack import free_port, wait_until
from prfaas.protos.prfaas.v1 import registry_pb2

DATA = Path(__file__).parent / "data"
P4D_FIXTURE = json.loads((DATA / "pricelist_p4d_us_east_1.json").read_text())["response"]
# AWS's recorded example (an EBS storage product priced per GB-month: no hourly instance price in it)
BOTOCORE_EXAMPLE = json.loads((Path(botocore.__file__).parent / "data/pricing/2017-10-15/examples-1.json").read_text())[
    "examples"
]["GetProducts"][0]["output"]
MOTO_SPOT_PRICE = 0.00001  # $/instance-hour: what moto's server answers for every offering
REGIONS = {
    "prefill-a": {
        "usd_per_gpu_hour": 2.0, "spot_usd_per_gpu_hour": 1.0, "aws_region": "us-east-1",
        "instance_type": "p4d.24xlarge", "gpus_per_instance": 8, "location": "US East (N. Virginia)",
    },
    "decode-b": {"usd_per_gpu_hour": 4.0},  # table only
    "odd-c": {
        "usd_per_gpu_hour": 3.0, "spot_usd_per_gpu_hour": 1.5, "aws_region": "us-east-1",
        "instance_type": "x9.nonexistent", "location": "US East (N. Virginia)",
    },
}  # fmt: skip


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    port = free_port()
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/moto-api/", timeout=1).status_code < 500
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, 30, 0.1)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


class PriceListReplay(BaseHTTPRequestHandler):
    """GetProducts: the p4d fixture when the filters ask for p4d.24xlarge, botocore's recorded example otherwise."""

    requests: list[dict[str, Any]] = []  # noqa: RUF012 (shared by the server's handler instances)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"target": self.headers.get("X-Amz-Target"), "body": body})
        asked = {f["Field"]: f["Value"] for f in body.get("Filters", [])}
        reply = P4D_FIXTURE if asked.get("instanceType") == "p4d.24xlarge" else BOTOCORE_EXAMPLE
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture(scope="module")
def pricelist() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), PriceListReplay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def settings() -> Iterator[Settings]:
    yield from settings_fixture()


def _book(settings: Settings, config: PriceConfig, clock: Any = time.time) -> PriceBook:
    client = redis.Redis.from_url(settings.redis_url)
    return PriceBook(client, settings.key("prices"), config, local_ttl_s=0.0, clock=clock)


def test_spot_and_on_demand_parsed_and_cached(
    settings: Settings, moto: str, pricelist: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = PriceConfig.model_validate({"regions": REGIONS})
    feed = PriceFeed(AwsSection(endpoint_url=moto), PricingSection(endpoint_url=pricelist))
    book = _book(settings, config)
    started = time.time()
    with caplog.at_level(logging.WARNING, logger="prfaas.control_plane.billing.prices"):
        quotes = {(q.region, q.market): q for q in book.refresh(feed)}
    took_s = time.time() - started
    spot = quotes[("prefill-a", "spot")]
    assert (spot.source, spot.usd_per_gpu_hour, spot.stale) == ("aws-spot", MOTO_SPOT_PRICE / 8, False)
    on_demand = quotes[("prefill-a", "on-demand")]
    assert (on_demand.source, on_demand.usd_per_gpu_hour) == ("aws-pricelist", pytest.approx(32.7726 / 8))
    assert on_demand.age_s is not None and 0 <= on_demand.age_s <= took_s  # fetched by this refresh
    sent = next(r for r in PriceListReplay.requests if r["body"].get("ServiceCode") == "AmazonEC2")
    assert sent["target"] == "AWSPriceListService.GetProducts"
    assert {f["Field"]: f["Value"] for f in sent["body"]["Filters"]}["location"] == "US East (N. Virginia)"
    # a table-only region: its table prices, never asked of AWS, no warning
    assert quotes[("decode-b", "on-demand")].source == "table" and ("decode-b", "spot") not in quotes
    # moto has no spot offer for an unknown type; the recorded example has no hourly price: the table, warned
    odd_spot, odd_od = quotes[("odd-c", "spot")], quotes[("odd-c", "on-demand")]
    assert (odd_spot.source, odd_spot.usd_per_gpu_hour) == ("table", 1.5) and "no spot price" in str(odd_spot.error)
    assert (odd_od.source, odd_od.usd_per_gpu_hour) == ("table", 3.0) and "no hourly" in str(odd_od.error)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("odd-c" in w and "spot" in w and "using the table" in w for w in warned), warned
    assert not any("decode-b" in w for w in warned)
    # another process's book reads the same cache
    assert _book(settings, config).spot("prefill-a") == MOTO_SPOT_PRICE / 8


def test_aws_unreachable_falls_back_to_the_table_with_a_warning(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = PriceConfig.model_validate({"regions": {"prefill-a": REGIONS["prefill-a"]}})
    feed = PriceFeed(AwsSection(endpoint_url=closed, timeout_s=2), PricingSection(endpoint_url=closed))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="prfaas.control_plane.billing.prices"):
        quotes = {q.market: q for q in _book(settings, config).refresh(feed)}
    assert time.monotonic() - started < 20
    assert (quotes["spot"].source, quotes["spot"].usd_per_gpu_hour) == ("table", 1.0)
    assert (quotes["on-demand"].source, quotes["on-demand"].usd_per_gpu_hour) == ("table", 2.0)
    assert "EndpointConnectionError" in str(quotes["spot"].error)
    assert sum("using the table" in r.getMessage() for r in caplog.records) == 2


def test_old_prices_are_flagged_stale(settings: Settings, moto: str, pricelist: str) -> None:
    now = [1_000_000.0]
    config = PriceConfig.model_validate({"max_age_s": 600, "regions": {"prefill-a": REGIONS["prefill-a"]}})
    book = _book(settings, config, clock=lambda: now[0])
    book.refresh(PriceFeed(AwsSection(endpoint_url=moto), PricingSection(endpoint_url=pricelist)))
    now[0] += 599
    assert not book.quote("prefill-a", "spot").stale  # type: ignore[union-attr]
    now[0] += 2
    spot = book.quote("prefill-a", "spot")
    assert spot is not None and spot.stale and spot.age_s == pytest.approx(601)
    assert spot.usd_per_gpu_hour == MOTO_SPOT_PRICE / 8  # still the last known price, flagged


def test_scheduler_snapshot_reads_the_prices(settings: Settings, moto: str, pricelist: str, tmp_path: Path) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text(yaml.safe_dump({"regions": REGIONS}))
    client = redis.Redis.from_url(settings.redis_url)
    registry = RegionRegistry(client, settings.model_copy(update={"prices": PricesSection(path=path)}))
    for name, price in (("prefill-a", 9.0), ("decode-b", 9.0), ("unpriced-d", 7.0)):
        registry.register(
            registry_pb2.RegisterRequest(name=name, role="both", usd_per_gpu_hour=price, heartbeat_interval_s=1.0)
        )
    registry.prices.local_ttl_s = 0.0
    feed = PriceFeed(AwsSection(endpoint_url=moto), PricingSection(endpoint_url=pricelist))
    registry.prices.refresh(feed)
    from prfaas.control_plane.scheduling.snapshot import ModelShape

    snap = {r.name: r for r in registry.snapshot(ModelShape(name="m", num_layers=2, kv_bytes_per_token=64)).regions}
    assert snap["prefill-a"].usd_per_gpu_hour == pytest.approx(32.7726 / 8)  # live on-demand, not the 9.0 registered
    assert snap["prefill-a"].spot_usd_per_gpu_hour == MOTO_SPOT_PRICE / 8
    assert (snap["decode-b"].usd_per_gpu_hour, snap["decode-b"].spot_usd_per_gpu_hour) == (4.0, None)  # the table
    assert snap["unpriced-d"].usd_per_gpu_hour == 7.0  # not configured: what the region registered


def test_beat_task_refreshes_prices_in_a_worker(settings: Settings, moto: str, pricelist: str, tmp_path: Path) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text(yaml.safe_dump({"refresh_s": 1, "regions": {"prefill-a": REGIONS["prefill-a"]}}))
    env = dict(
        os.environ, PRFAAS_DEV="1", PRFAAS_REDIS_URL=settings.redis_url, PRFAAS_KEY_PREFIX=settings.key_prefix,
        PRFAAS_ADMIN_KEY=settings.admin_key.get_secret_value(),
        PRFAAS_TICKET_KEY=settings.ticket_key.get_secret_value(),
        PRFAAS_PRICES_PATH=str(path), PRFAAS_AWS_ENDPOINT_URL=moto, PRFAAS_PRICING_ENDPOINT_URL=pricelist,
        PRFAAS_LEDGER_URL=f"sqlite:///{tmp_path / 'ledger.db'}", AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
    )  # fmt: skip
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "prfaas.control_plane.worker", "worker", "-B",
         "-s", str(tmp_path / "beat-schedule"), "--pool", "threads", "-c", "2", "--without-gossip",
         "--without-mingle", "--loglevel", "WARNING"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    client = redis.Redis.from_url(settings.redis_url)
    try:

        def fetched_at() -> float:
            raw = client.hget(settings.key("prices"), "prefill-a|spot")
            return float(json.loads(raw)["fetched_at"]) if raw else 0.0

        wait_until(lambda: fetched_at() > 0, 60, 0.2)
        first = json.loads(client.hget(settings.key("prices"), "prefill-a|spot"))  # type: ignore[arg-type]
        assert (first["source"], first["usd"]) == ("aws-spot", MOTO_SPOT_PRICE / 8)
        seen = fetched_at()
        wait_until(lambda: fetched_at() > seen, 15, 0.2)  # refreshed again on schedule (every 1 s)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the group: `-B` forks the embedded beat into a child process
        proc.wait(10)
        client.close()
