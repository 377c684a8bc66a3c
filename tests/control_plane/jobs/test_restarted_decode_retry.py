"""A job whose decode instance died and came back (real Redis; the regions are test servicers on real gRPC
servers, registered and beating): the instance failed attempt 1 at Reserve (UNAVAILABLE), so attempt 2 leaves
that incarnation out, and while it is the only decode region the job waits, its placement saying the region is
excluded for this job (not unhealthy: it is alive). Once the instance restarts (it registers again under the
same id), attempt 2 runs on it. Before, the id stayed excluded: the job was placed every second and FAILED
"no placement: no decode region: filter 'health' cut the last of 1" while the region sat idle."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from cp_kit import services_fixture
from fake_regions import FakeRegions
from test_dispatch_faults import Decode, Prefill, _job

from prfaas.control_plane.jobs.dispatch import Dispatcher
from prfaas.control_plane.scheduling.errors import PlacementRejected
from prfaas.control_plane.services import Services


class Dying(Decode):
    down = False  # Reserve answers UNAVAILABLE, as from a process killed mid-job
    before_abort: Callable[[], None] | None = None  # what happens meanwhile (the instance restarts)

    async def Reserve(self, request: Any, context: Any) -> Any:  # noqa: N802
        if self.down:
            if self.before_abort is not None:
                self.before_abort()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return await super().Reserve(request, context)


@pytest.fixture
def services() -> Iterator[Services]:
    yield from services_fixture(job={"timeout_s": 20})


@pytest.fixture
def regions(services: Services) -> Iterator[FakeRegions]:
    regions = FakeRegions(services.regions, Prefill(), Dying())
    yield regions
    regions.close()


def _until_healthy(services: Services, name: str) -> None:
    """Until `name` takes work again (the failed call's `suspect` mark lasts its missed beats, 1.5 s)."""
    deadline = time.monotonic() + 10
    while not services.regions.get(name).healthy:
        assert time.monotonic() < deadline, services.regions.get(name)
        time.sleep(0.05)


def _failed_once(services: Services, regions: FakeRegions, dispatcher: Dispatcher) -> str:
    """A job whose attempt 1 failed at Reserve in decode-t/i0, now answering again (a stall, a partition: the
    same incarnation) and taking work (its `suspect` mark spent)."""
    job_id = _job(services)
    regions.decode.down = True
    assert dispatcher.run(job_id) == "retrying"
    regions.decode.down = False
    _until_healthy(services, "decode-t")
    job = services.jobs.get(job_id)
    assert [e.split("@")[0] for e in json.loads(job["excluded"])] == ["decode-t/i0"], job
    return job_id


def _dispatcher(services: Services) -> Dispatcher:
    return Dispatcher(services, lambda *_: None, owner="worker:t")


def test_a_restarted_decode_instance_serves_the_job_its_old_incarnation_failed(
    services: Services, regions: FakeRegions
) -> None:
    dispatcher = _dispatcher(services)
    job_id = _failed_once(services, regions, dispatcher)
    assert dispatcher.run(job_id) == "unplaced"  # the only decode region: its one instance is left out

    decode = services.regions.get("decode-t").instances[0]
    regions.tokens["decode"] = regions._register("decode", int(decode.grpc_endpoint.rsplit(":", 1)[1]))  # restart
    assert dispatcher.run(job_id) == "started"
    deadline = time.monotonic() + 10
    while dispatcher.watcher.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    job = services.jobs.get(job_id)
    assert (job["attempt"], job["decode_region"], job["decode_instance"]) == ("2", "decode-t", "i0"), job
    assert job["state"] not in ("FAILED", "QUEUED"), job


def test_the_same_incarnation_stays_excluded_and_the_placement_says_so(
    services: Services, regions: FakeRegions
) -> None:
    dispatcher = _dispatcher(services)
    job_id = _failed_once(services, regions, dispatcher)
    assert dispatcher.run(job_id) == "unplaced"
    job = services.jobs.get(job_id)
    assert (job["state"], job["attempt"]) == ("QUEUED", "2"), job
    with pytest.raises(PlacementRejected, match="no decode region: filter 'excluded' cut the last of 1"):
        dispatcher.decide(job, frozenset(json.loads(job["excluded"])))  # alive: not blamed on 'health'


def test_an_instance_restarted_before_its_failure_is_noticed_serves_the_next_attempt(
    services: Services, regions: FakeRegions
) -> None:
    """The decode instance restarts while attempt 1's Reserve to its old incarnation is failing (the failure is
    noticed after the new one registered): attempt 2 leaves out the incarnation placed, not the new one. Before,
    the exclusion was stamped with the failure's time, which the new registration preceded: left out for good."""
    dispatcher = _dispatcher(services)
    job_id = _job(services)
    decode = services.regions.get("decode-t").instances[0]
    port = int(decode.grpc_endpoint.rsplit(":", 1)[1])

    def restarted() -> None:
        time.sleep(0.01)  # Redis's clock moves on: the new incarnation registers after the one placed
        regions.tokens["decode"] = regions._register("decode", port)

    regions.decode.down, regions.decode.before_abort = True, restarted
    assert dispatcher.run(job_id) == "retrying"
    regions.decode.down = False
    assert services.regions.get("decode-t").instances[0].registered_at > decode.registered_at
    (excluded,) = json.loads(services.jobs.get(job_id)["excluded"])
    assert excluded.startswith("decode-t/i0@")
    _until_healthy(services, "decode-t")
    assert dispatcher.run(job_id) == "started"
    job = services.jobs.get(job_id)
    assert (job["attempt"], job["decode_instance"], job["state"]) == ("2", "i0", "PREFILLING"), job
