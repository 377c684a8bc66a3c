"""A job's exclusions name incarnations, not instance ids (real Redis): an instance that failed an attempt is
left out of the job's later placements, but a restarted one keeps its id (the host name, by default) and
registers again, and that new incarnation may serve the job. Before, the id was left out for good: with one
decode region, the job sat QUEUED while the region was idle, then FAILED "filter 'health' cut the last of 1".
A plain `region/instance` entry (a job queued before incarnations were told apart) still leaves out the id."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cp_kit import registry_fixture

from prfaas.control_plane.fleet.records import RegionNotFound, exclusion
from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.scheduling.snapshot import ModelShape
from prfaas.protos.prfaas.v1 import registry_pb2

MODEL = ModelShape(name="tiny-llama", num_layers=4, kv_bytes_per_token=1024)


@pytest.fixture
def reg() -> Iterator[RegionRegistry]:
    yield from registry_fixture()


def _register(reg: RegionRegistry, instance: str = "vm") -> str:
    return reg.register(registry_pb2.RegisterRequest(
        name="dec", role="decode", gpu_type="cpu", num_workers=1, usd_per_gpu_hour=1.0, grpc_endpoint="127.0.0.1:1",
        kv_endpoint="127.0.0.1:2", model="tiny-llama", kv_buffer_bytes=1 << 30, heartbeat_interval_s=1.0,
        instance=instance,
    ))  # fmt: skip


def _usable(reg: RegionRegistry, exclude: frozenset[str]) -> bool:
    """Whether a placement leaving out `exclude` may use region `dec`: its snapshot and its pick agree."""
    region = reg.snapshot(MODEL, exclude=exclude).region("dec")
    try:
        reg.get("dec").pick(exclude)
    except RegionNotFound:
        assert not region.healthy and region.excluded
        return False
    assert region.healthy and not region.excluded
    return True


def test_a_restarted_instance_may_serve_the_job_its_last_incarnation_failed(reg: RegionRegistry) -> None:
    _register(reg)
    failed = frozenset({exclusion("dec/vm", reg.clock())})  # what Attempts.fail writes
    assert not _usable(reg, failed)  # the incarnation that failed is left out, as before
    _register(reg)  # restarted: registers again under its id
    assert _usable(reg, failed)


def test_a_plain_entry_leaves_out_every_incarnation_of_the_instance(reg: RegionRegistry) -> None:
    _register(reg)
    _register(reg)
    assert not _usable(reg, frozenset({"dec/vm"}))  # a job queued before: its entry keeps its meaning
    region = reg.snapshot(MODEL, exclude=frozenset({"dec"})).region("dec")  # a region by name (the snapshot's)
    assert not region.healthy and region.excluded


def test_an_exclusion_leaves_out_only_its_own_instance(reg: RegionRegistry) -> None:
    _register(reg, "vm")
    failed = frozenset({exclusion("dec/vm", reg.clock())})
    _register(reg, "vm2")  # another instance, joined since: never was excluded
    assert reg.get("dec").pick(failed).instance == "vm2"
    assert not _usable(reg, failed | {exclusion("dec/vm2", reg.clock())})


def test_an_entry_whose_time_is_not_one_leaves_out_every_incarnation(reg: RegionRegistry) -> None:
    _register(reg)
    assert not _usable(reg, frozenset({"dec/vm@soon"}))
    assert not _usable(reg, frozenset({"dec/vm@nan"}))
