"""A split job that failed over is billed what its answering attempt shipped (real Redis, the ledger in a
SQLite file): the first attempt's KV bytes, recorded before it failed, are not the bill's, and the biller
waits for the last attempt's, which its prefill region reports after DONE."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cp_kit import settings_fixture

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.leases import Leases
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services
from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import Quota

PRICES = {"prefill-a": {"usd_per_gpu_hour": 1.2}, "prefill-c": {"usd_per_gpu_hour": 1.2},
          "decode-b": {"usd_per_gpu_hour": 3.5}}  # fmt: skip
FIRST_WIRE, LAST_WIRE = 900_000_000, 2_000_000


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[Settings]:
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"max_age_s": 3600, "refresh_s": 3600, "regions": PRICES}))
    yield from settings_fixture(prices={"path": str(prices)})


def _split(services: Services, job: str, attempt: int, prefill: str) -> None:
    jobs = services.jobs
    jobs.update(job, attempt, placement_chosen="split", prefill_region=prefill, decode_region="decode-b")
    jobs.transition(job, JobState.PREFILLING, attempt, note=f"prefill in {prefill}")
    jobs.update(job, attempt, bytes_raw=4 * LAST_WIRE, prefill_gpu_s=0.1)  # at prefill_done: raw bytes only
    jobs.transition(job, JobState.TRANSFERRING, attempt, note="prefill done, KV shipping")


def test_a_failed_over_split_job_is_billed_its_last_attempts_wire_bytes(settings: Settings) -> None:
    services = Services.create(settings)
    ledger = Ledger(settings.ledger.url)
    try:
        jobs = services.jobs
        fields = {"model": "tiny-llama", "prompt_tokens": 5, "max_new_tokens": 3}
        job = jobs.create("t-" + uuid.uuid4().hex[:8], fields, Quota(rps=100, concurrency=100, budget_usd=100)).job_id
        _split(services, job, 1, "prefill-a")
        jobs.update(job, 1, bytes_wire=FIRST_WIRE)  # shipped, then the decode region died
        attempts = Attempts(jobs, Leases(services.redis, settings), lambda *_: None, "test")
        assert attempts.fail(job, 1, "decode-b/0", "decode: UNAVAILABLE") == "retrying"
        assert int(jobs.get(job)["bytes_wire"]) == 0  # the new attempt has shipped nothing yet

        _split(services, job, 2, "prefill-c")
        jobs.transition(job, JobState.DECODING, 2, note="decoding")
        jobs.transition(job, JobState.DONE, 2, completion_tokens=3, gen_first_s=0.2, gen_last_s=0.4)
        # the prefill region's shipment_complete comes after DONE (the dispatcher records it then)
        late = threading.Timer(0.5, lambda: jobs.update(job, 2, bytes_wire=LAST_WIRE))
        late.start()
        entry = Meter(services, ledger).bill(job)
        late.join()
        assert entry is not None and entry.attempts == 2
        assert (entry.prefill_region, entry.kv_bytes_wire) == ("prefill-c", LAST_WIRE)
    finally:
        ledger.close()
        services.close()
