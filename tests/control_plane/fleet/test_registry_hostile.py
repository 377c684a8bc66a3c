"""The region registry under figures no healthy region sends (real Redis): one region's registration,
heartbeat or link report must never stop the snapshot every placement reads, for that region or the others.
Refused at the gate: names that are not region names, a price or heartbeat interval that is not one. Taken as
unmeasured: rates that are not finite or out of any GPU's reach. Dropped: link reports no path gives, and
stored records nobody can read. Also: a retry's excluded instance no longer counts in its region's capacity
and cache, a link's RTT and bandwidth are bounded, and a NaN cost scores last wherever it stands. And what
regions report of their queues reaches the cost model: a decode region's wait per job (`mean_job_s`), a prefill
region's queue limit; a region serving another model than the control plane's is refused."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
from cp_kit import registry_fixture
from pydantic import ValidationError
from test_link_estimates import link_report

from prfaas.control_plane.fleet.links import LinkEstimate
from prfaas.control_plane.fleet.registry import ESTIMATE_KEPT_S, RegionRegistry
from prfaas.control_plane.fleet.snapshots import FALLBACK_DECODE_TPS
from prfaas.control_plane.scheduling.costmodel import CostModel
from prfaas.control_plane.scheduling.request import Priority
from prfaas.control_plane.scheduling.scorers import relative_to_best
from prfaas.control_plane.scheduling.snapshot import Link, ModelShape
from prfaas.protos.prfaas.v1 import registry_pb2
from prfaas.region.channels import MAX_PREFIX_BLOCKS

MODEL = ModelShape(name="tiny-llama", num_layers=4, kv_bytes_per_token=1024)
INF, NAN = float("inf"), float("nan")


@pytest.fixture
def reg() -> Iterator[RegionRegistry]:
    yield from registry_fixture()


def _register(reg: RegionRegistry, name: str, role: str = "decode", **fields: object) -> str:
    request = registry_pb2.RegisterRequest(
        name=name, role=role, gpu_type="cpu", num_workers=2, usd_per_gpu_hour=1.0, grpc_endpoint="127.0.0.1:1",
        kv_endpoint="127.0.0.1:2", model="tiny-llama", kv_buffer_bytes=1 << 30, heartbeat_interval_s=1.0,
    )  # fmt: skip
    for field, value in fields.items():
        setattr(request, field, value)
    return reg.register(request)


def _beat(reg: RegionRegistry, name: str, token: str, instance: str = "", **load: object) -> bool:
    links = load.pop("links", [])
    figures = {"kv_free_bytes": 1 << 30, "decode_tokens_per_s": 40.0, "prefill_tokens_per_s": 5000.0} | load
    request = registry_pb2.HeartbeatRequest(name=name, region_id=token, instance=instance,
                                            load=registry_pb2.Load(**figures, links=links))  # fmt: skip
    return reg.heartbeat(request)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "dec/a"}, "region name"),
        ({"name": "Dec"}, "region name"),
        ({"name": "dec\n"}, "region name"),
        ({"instance": "a/b"}, "instance id"),
        ({"instance": "a>b"}, "instance id"),
        ({"usd_per_gpu_hour": -1.0}, "usd_per_gpu_hour"),
        ({"usd_per_gpu_hour": NAN}, "usd_per_gpu_hour"),
        ({"usd_per_gpu_hour": INF}, "usd_per_gpu_hour"),
        ({"heartbeat_interval_s": INF}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": 86400.0}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": NAN}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": -1.0}, "heartbeat_interval_s"),
    ],
)
def test_a_registration_no_region_sends_is_refused(reg: RegionRegistry, fields: dict, message: str) -> None:
    fields = {"name": "dec"} | fields
    with pytest.raises(ValueError, match=message):
        _register(reg, **fields)
    assert reg.snapshot(MODEL).regions == ()


@pytest.mark.parametrize("rate", [INF, NAN, -5.0, 1e-310, 1e300])
def test_an_impossible_rate_is_taken_as_unmeasured(reg: RegionRegistry, rate: float) -> None:
    good, odd = _register(reg, "good"), _register(reg, "odd")
    assert not _beat(reg, "good", good)
    assert not _beat(reg, "odd", odd, decode_tokens_per_s=rate, prefill_tokens_per_s=rate)
    regions = reg.snapshot(MODEL).regions_by_name()  # before: ValidationError for every placement
    assert set(regions) == {"good", "odd"}
    assert regions["odd"].decode_tokens_per_s == 40.0  # the measured prior of its GPU type (the good region's)
    assert math.isfinite(regions["odd"].tpot_ms)
    alone = _register(reg, "alone", gpu_type="h100")
    assert not _beat(reg, "alone", alone, decode_tokens_per_s=rate)
    assert reg.snapshot(MODEL).regions_by_name()["alone"].decode_tokens_per_s == FALLBACK_DECODE_TPS


@pytest.mark.parametrize(
    "report",
    [
        registry_pb2.LinkReport(peer_region="dec", seconds=5.0, backlogged_s=INF, backlogged_bytes=1000),
        registry_pb2.LinkReport(peer_region="dec", seconds=1e-300, bytes_acked=10**12),
        registry_pb2.LinkReport(peer_region="dec", seconds=NAN, bytes_acked=1000),
        registry_pb2.LinkReport(peer_region="dec", seconds=5.0, bytes_acked=1000, min_rtt_ms=1e300),
        registry_pb2.LinkReport(peer_region="dec", seconds=5.0, bytes_acked=1000, srtt_ms=-1.0),
    ],
)
def test_a_link_report_no_path_gives_is_dropped(reg: RegionRegistry, report: registry_pb2.LinkReport) -> None:
    pre, dec = _register(reg, "pre", "prefill"), _register(reg, "dec")
    reg.set_link(Link(src="pre", dst="dec", rtt_ms=40.0, bandwidth_gbps=10.0))
    assert not _beat(reg, "pre", pre, links=[link_report(2.0)])
    before = reg.link_estimates()[("pre", "dec")]
    assert not _beat(reg, "pre", pre, links=[report])  # before: the estimate stored inf (as null) or overflowed
    assert not _beat(reg, "dec", dec)
    after = reg.link_estimates()[("pre", "dec")]
    assert after.model_dump(exclude={"updated_at"}) == before.model_dump(exclude={"updated_at"})
    (link,) = reg.snapshot(MODEL).links
    assert link.rtt_ms == pytest.approx(40.0) and link.bandwidth_gbps == pytest.approx(2.0, rel=0.5)


def test_records_nobody_can_read_are_dropped_not_fatal(reg: RegionRegistry) -> None:
    token = _register(reg, "dec")
    _register(reg, "broken")
    s = reg.settings
    reg.redis.hdel(s.key("instance", "broken/0"), "num_workers")  # a partial write
    reg.redis.hset(s.key("link_estimates"), "pre>dec", b"{not json")
    stale = LinkEstimate(src="old", dst="dec", updated_at=time.time() - ESTIMATE_KEPT_S - 1)
    reg.redis.hset(s.key("link_estimates"), "old>dec", stale.model_dump_json())
    assert [r.name for r in reg.snapshot(MODEL).regions] == ["dec"]
    assert reg.link_estimates() == {} and not reg.redis.exists(s.key("link_estimates"))
    assert _beat(reg, "broken", "any")  # forgotten: it registers again
    assert not _beat(reg, "dec", token)


def test_a_beat_keeps_as_many_prefix_blocks_as_a_region_publishes_and_only_digests(reg: RegionRegistry) -> None:
    """Every snapshot (every placement, fleet-wide) reads and parses each instance's blocks: before, a beat of a
    million blocks was kept whole and made each snapshot hundreds of times slower."""
    token = _register(reg, "dec")
    flood = [f"{i:016x}" for i in range(3 * MAX_PREFIX_BLOCKS)]  # short digests (engine/blocks.py `short`)
    odd = ["a,b", "not-a-digest", "", "0" * 17]  # none is one: ',' would even split into two
    assert not _beat(reg, "dec", token, prefix_version=1, prefix_blocks=odd + flood, prefix_included=True)
    # the first MAX_PREFIX_BLOCKS (a region sends its most recently used first), less the 4 that are no digest
    assert reg.get("dec").prefix_blocks == set(flood[: MAX_PREFIX_BLOCKS - len(odd)])


def test_a_beat_reports_on_region_names_only(reg: RegionRegistry) -> None:
    pre = _register(reg, "pre", "prefill")
    odd = [registry_pb2.LinkReport(peer_region=name, seconds=1.0, bytes_acked=1) for name in ("a>b", "x/y", "")]
    assert not _beat(reg, "pre", pre, links=odd)
    assert reg.link_estimates() == {}


def test_a_retry_sees_its_region_without_the_instance_it_excludes(reg: RegionRegistry) -> None:
    a = _register(reg, "dec", instance="a", kv_buffer_bytes=1 << 30)
    b = _register(reg, "dec", instance="b", kv_buffer_bytes=1 << 30)
    assert not _beat(reg, "dec", a, instance="a", kv_free_bytes=1 << 30)
    assert not _beat(reg, "dec", b, instance="b", kv_free_bytes=0, busy_workers=2)
    region = reg.snapshot(MODEL, exclude=frozenset({"dec/a"})).regions_by_name()["dec"]
    assert region.healthy and region.kv_buffer_free_bytes == 0 and region.num_busy_workers == 2
    assert reg.snapshot(MODEL).regions_by_name()["dec"].kv_buffer_free_bytes == 1 << 30


@pytest.mark.parametrize("bad", [{"rtt_ms": 1e300}, {"bandwidth_gbps": 1e300}, {"rtt_ms": INF}])
def test_a_links_figures_are_bounded(bad: dict[str, float]) -> None:
    """(Before, a huge RTT from the admin API or a heartbeat made every decision raise OverflowError.)"""
    with pytest.raises(ValidationError):
        Link(**({"src": "pre", "dst": "dec", "rtt_ms": 40.0, "bandwidth_gbps": 10.0} | bad))


def test_a_nan_cost_scores_last_wherever_it_stands() -> None:
    assert relative_to_best([NAN, 2.0, 1.0]) == [0.0, 0.5, 1.0]
    assert relative_to_best([2.0, NAN, 1.0]) == [0.5, 0.0, 1.0]


def test_a_busy_decode_region_predicts_the_wait_of_its_queue(reg: RegionRegistry) -> None:
    """A decode region reports its queue in jobs, each holding a worker for its whole generation (mean_job_s),
    not in prompt tokens: the snapshot gives the cost model the jobs formula. (Before, its zero queued tokens
    made a region with 200 jobs waiting and every worker busy predict no wait, score as idle and pass the slo
    filter.)"""
    busy, idle = _register(reg, "busy"), _register(reg, "idle")
    assert not _beat(reg, "busy", busy, queue_depth=200, busy_workers=2, mean_job_s=2.0)
    assert not _beat(reg, "idle", idle, mean_job_s=2.0)
    regions = reg.snapshot(MODEL).regions_by_name()
    assert CostModel.queue_wait_s(regions["busy"], Priority.NORMAL) == pytest.approx((200 + 1) / 2 * 2.0)
    assert CostModel.queue_wait_s(regions["idle"], Priority.NORMAL) == 0.0
    pre = _register(reg, "pre", "prefill")
    assert not _beat(reg, "pre", pre, queue_depth=3, busy_workers=2, queued_prefill_tokens=15_000)
    prefill = reg.snapshot(MODEL).regions_by_name()["pre"]
    assert CostModel.queue_wait_s(prefill, Priority.NORMAL) == pytest.approx(15_000 / (2 * 5000.0))  # in tokens


def test_a_prefill_region_whose_queue_is_full_is_full_in_the_snapshot(reg: RegionRegistry) -> None:
    """A prefill region registers how many jobs it queues beyond its workers; a full one is `queue_full`, which
    the capacity filter cuts (before, it was never set: a full region was picked and refused the Prefill)."""
    pre = _register(reg, "pre", "prefill", queue_limit=2)
    assert not _beat(reg, "pre", pre, queue_depth=1, busy_workers=2)
    assert not reg.snapshot(MODEL).regions_by_name()["pre"].queue_full
    assert not _beat(reg, "pre", pre, queue_depth=2, busy_workers=2)
    region = reg.snapshot(MODEL).regions_by_name()["pre"]
    assert region.queue_capacity == 2 and region.queue_full
    assert reg.snapshot(MODEL).regions_by_name()["pre"].queue_capacity == 2
    unsaid = _register(reg, "old", "prefill")  # a region that does not say: no limit known
    assert not _beat(reg, "old", unsaid, queue_depth=50, busy_workers=2)
    assert reg.snapshot(MODEL).regions_by_name()["old"].queue_capacity is None


def test_a_region_serving_another_model_is_refused(reg: RegionRegistry) -> None:
    """Local jobs run on the decode region's own model: one serving another model would answer them with that
    model's tokens. A registration whose fingerprint is not the served model's is refused (one that says none,
    from an older region, is let in)."""
    served = RegionRegistry(reg.redis, reg.settings, served=lambda: "f" * 32)
    with pytest.raises(ValueError, match="serves model"):
        _register(served, "dec", model_fingerprint="e" * 32)
    _register(served, "dec", model_fingerprint="f" * 32)
    _register(served, "old")
    assert [r.name for r in served.snapshot(MODEL).regions] == ["dec", "old"]


def test_the_served_models_fingerprint_is_the_regions_engines() -> None:
    from prfaas.control_plane.services import ServedModel
    from prfaas.engine.base import ModelFacts

    assert ServedModel("tiny-llama").fingerprint == ModelFacts.read("tiny-llama", "float32").fingerprint
    assert ServedModel("tiny-llama", "pinned").fingerprint == "pinned"


def test_a_stored_link_that_no_longer_validates_is_left_out_not_fatal(reg: RegionRegistry) -> None:
    """A configured link stored before a bound was added (an RTT over 60 s), by hand or not JSON is logged and
    left out; the others and every region stay. (Before, it made every snapshot raise: no placement at all.)"""
    for name, role in (("dec", "decode"), ("pre", "prefill")):
        assert not _beat(reg, name, _register(reg, name, role))
    reg.set_link(Link(src="pre", dst="dec", rtt_ms=40.0, bandwidth_gbps=10.0))
    key = reg.settings.key("links")
    reg.redis.hset(key, "old>dec", '{"src": "old", "dst": "dec", "rtt_ms": 70000, "bandwidth_gbps": 10}')
    reg.redis.hset(key, "hand>dec", "{not json")
    assert [(link.src, link.dst) for link in reg.configured_links()] == [("pre", "dec")]
    snapshot = reg.snapshot(MODEL)
    assert [r.name for r in snapshot.regions] == ["dec", "pre"] and len(snapshot.links) == 1
