"""The cost and latency model, formula by formula (docs/scheduler.md, "Cost and latency model")."""

from __future__ import annotations

import math

import pytest
from sched_kit import MODEL, fleet, hashes, link, region, request

from prfaas.control_plane.scheduling import ModelShape, Priority, Role, build_scheduler
from prfaas.control_plane.scheduling.costmodel import CodecOption, CostModel

RAW = CodecOption("raw", 1.0, False)
LOSSLESS = CodecOption("lossless", 1.5, False, encode_bytes_per_s=2e9)
INT8 = CodecOption("int8", 2.0, True, encode_bytes_per_s=2e9)
MODEL_3 = CostModel([RAW, LOSSLESS, INT8])


@pytest.mark.parametrize(
    ("workers", "busy", "queued", "priority", "expected_s"),
    [
        (2, 1, 0, Priority.NORMAL, 0.0),  # an idle worker, nothing ahead: no wait
        (2, 2, 0, Priority.NORMAL, 0.5),  # all busy: the first to free, (0 + 1) / 2 workers * 1 s
        (2, 2, 3, Priority.NORMAL, 2.0),  # 3 queued + 1: (3 + 1) / 2 * 1 s
        (2, 2, 3, Priority.LOW, 2.0),  # low waits like normal
        (2, 2, 3, Priority.HIGH, 0.5),  # high skips the queue, still waits for a worker
        (4, 1, 2, Priority.NORMAL, 0.0),  # 3 idle workers take the 2 queued and this one
    ],
)
def test_queue_wait(workers: int, busy: int, queued: int, priority: Priority, expected_s: float) -> None:
    r = region("r", num_workers=workers, num_gpus=8 * workers, num_busy_workers=busy, queue_depth=queued)
    assert CostModel.queue_wait_s(r, priority) == pytest.approx(expected_s)


@pytest.mark.parametrize(
    ("busy", "queued_jobs", "queued_tokens", "running_tokens", "priority", "expected_s"),
    [
        (1, 0, 0, 3_000, Priority.NORMAL, 0.0),  # an idle worker of 2, nothing queued: no wait
        (2, 0, 0, 8_000, Priority.NORMAL, 0.2),  # both busy: half of 8,000 running tokens left / (2 x 10,000 tok/s)
        (2, 2, 12_000, 8_000, Priority.NORMAL, 0.8),  # + 12,000 queued: (12,000 + 4,000) / 20,000 tok/s
        (2, 2, 12_000, 8_000, Priority.HIGH, 0.2),  # high skips the queue: the running work's half only
    ],
)
def test_queue_wait_in_tokens(
    busy: int, queued_jobs: int, queued_tokens: int, running_tokens: int, priority: Priority, expected_s: float
) -> None:
    r = region("r", num_workers=2, num_gpus=16, num_busy_workers=busy, queue_depth=queued_jobs,
               prefill_tokens_per_s=10_000.0, queued_prefill_tokens=queued_tokens,
               running_prefill_tokens=running_tokens, mean_prefill_s=99.0)  # fmt: skip  # the job means unused
    assert CostModel.queue_wait_s(r, priority) == pytest.approx(expected_s)


def test_local_estimate() -> None:
    # 8 GPUs in 2 workers: 4 GPUs per worker. 30,000 tokens at 10,000 tok/s = 3 s.
    r = region("r", num_gpus=8, num_workers=2, prefill_tokens_per_s=10_000.0, usd_per_gpu_hour=3.6)
    estimate = MODEL_3.local(request(30_000, max_new_tokens=500), r, 30_000)
    assert estimate.ttft_s == pytest.approx(3.0)
    assert estimate.prefill_usd == pytest.approx(3.0 * 4 * 3.6 / 3600)  # $0.012
    assert estimate.decode_usd == pytest.approx(500 / 5_000 * 4 * 3.6 / 3600)  # 0.1 GPU-worker-s
    assert estimate.tpot_s == pytest.approx(0.030)
    assert (estimate.transfer, estimate.egress_usd) == (None, 0.0)


@pytest.mark.parametrize(("on_spot", "price"), [(True, 0.9), (False, 1.8)])
def test_split_prefill_uses_spot_price_when_allowed(on_spot: bool, price: float) -> None:
    model = CostModel([RAW], prefill_on_spot=on_spot)
    pre = region("p", Role.PREFILL, usd_per_gpu_hour=1.8, spot_usd_per_gpu_hour=0.9)
    dec = region("d")
    estimate = model.split(request(30_000), MODEL, pre, dec, link("p", "d"), 30_000, 30_000)
    assert estimate.prefill_usd == pytest.approx(30_000 / 15_000 * 8 * price / 3600)


def _exposed(gbps: float, raw: int, prefill_s: float, layers: int, rtt_ms: float = 0.0) -> float:
    shape = ModelShape(name="m", num_layers=layers, kv_bytes_per_token=1)
    plan = CostModel([RAW]).plan_transfer(
        request(), shape, link("p", "d", bandwidth_gbps=gbps, utilization=0.0, rtt_ms=rtt_ms), raw, prefill_s, 1e9
    )
    return plan.exposed_s


def test_transfer_hidden_behind_prefill_but_the_last_layer() -> None:
    # 8 Gbit/s = 1 GB/s; 1 GB over 10 layers; prefill 10 s (1 s per layer, each layer's 0.1 GB
    # takes 0.1 s): only the last layer's 0.1 s shows, plus half the 40 ms RTT.
    assert _exposed(8.0, 10**9, 10.0, 10, rtt_ms=40.0) == pytest.approx(0.1 + 0.02)


def test_transfer_slower_than_prefill_shows_the_difference() -> None:
    # 1 GB at 0.1 GB/s = 10 s; prefill 2 s over 4 layers overlaps 2 * 3/4 = 1.5 s of it.
    assert _exposed(0.8, 10**9, 2.0, 4) == pytest.approx(10.0 - 1.5)


def test_no_bandwidth_means_the_transfer_never_ends() -> None:
    assert _exposed(0.0, 10**9, 2.0, 4) == math.inf
    assert _exposed(0.0, 0, 2.0, 4, rtt_ms=10.0) == pytest.approx(0.005)  # nothing to ship


def test_codec_is_the_fewest_wire_bytes_that_fit_the_budget() -> None:
    pre, dec = region("p", Role.PREFILL), region("d")
    lnk = link("p", "d", bandwidth_gbps=1.0, utilization=0.0, rtt_ms=0.0)  # 125 MB/s
    # 30,000 tokens * 16 KiB = 491.5 MB; 2 s prefill at 15k tok/s. Lossless (1.5x, 187.5 MB/s) lands
    # 2.62 - 1.93 = 0.69 s after the prefill: 26 % of its 2.69 s TTFT, so a lossy codec pays; int8
    # (2x, 250 MB/s) fits the 4 s budget with the fewest wire bytes.
    strict = MODEL_3.split(request(30_000), MODEL, pre, dec, lnk, 30_000, 30_000).transfer
    assert strict is not None and strict.codec == "lossless"
    lossy_ok = MODEL_3.split(request(30_000, allow_lossy_codec=True), MODEL, pre, dec, lnk, 30_000, 30_000).transfer
    assert lossy_ok is not None and lossy_ok.codec == "int8"


def test_a_lossy_codec_is_not_used_where_the_link_keeps_up() -> None:
    pre, dec = region("p", Role.PREFILL), region("d")
    lnk = link("p", "d", bandwidth_gbps=8.0, utilization=0.0, rtt_ms=0.0)  # 1 GB/s: the prefill hides every codec
    lossy_ok = MODEL_3.split(request(30_000, allow_lossy_codec=True), MODEL, pre, dec, lnk, 30_000, 30_000).transfer
    assert lossy_ok is not None and lossy_ok.codec == "lossless"  # exposed ~0.02 s of 2 s: nothing worth its error


def test_codec_falls_back_to_the_fastest_when_none_fits() -> None:
    # 100 Gbit/s link, encoders at 2 GB/s: raw (12.5 GB/s) is faster than lossless (2 GB/s).
    # 400k tokens = 6.6 GB, 15k tok/s prefill = 26.7 s > 1 s TTFT: nothing fits, take the fastest.
    lnk = link("p", "d", bandwidth_gbps=100.0, utilization=0.0)
    estimate = MODEL_3.split(
        request(400_000, slo={"ttft_ms": 1_000.0, "tpot_ms": 50.0}),
        MODEL,
        region("p", Role.PREFILL),
        region("d"),
        lnk,
        400_000,
        400_000,
    )
    assert estimate.transfer is not None and estimate.transfer.codec == "raw"


@pytest.mark.parametrize(
    ("gbps", "rtt_ms", "expected"),
    [
        (100.0, 40.0, 64),  # 12.5 GB/s * 40 ms = 500 MB: 120 windows of 4 MiB, capped at 64
        (1.0, 40.0, 2),  # 125 MB/s * 40 ms = 5 MB: 2 windows
        (1.0, 1.0, 1),  # 125 KB in flight: one stream
        (0.0, 40.0, 1),  # no bandwidth: the minimum
        (100_000.0, 60_000.0, 64),  # the longest, widest link a snapshot holds: capped, no overflow
    ],
)
def test_stream_count_covers_the_bandwidth_delay_product(gbps: float, rtt_ms: float, expected: int) -> None:
    lnk = link("p", "d", bandwidth_gbps=gbps, utilization=0.0, rtt_ms=rtt_ms)
    plan = MODEL_3.plan_transfer(request(), MODEL, lnk, 10**6, 1.0, 10.0)
    assert plan.num_streams == expected


def test_split_ships_only_what_the_decode_region_lacks() -> None:
    # The decode region holds 10,000 of 30,000 tokens: 20,000 tokens of KV cross the link,
    # though the prefill region (cold) computes all 30,000.
    pre, dec = region("p", Role.PREFILL), region("d")
    estimate = MODEL_3.split(request(30_000), MODEL, pre, dec, link("p", "d"), 30_000, 20_000)
    assert estimate.uncached_tokens == 30_000
    assert estimate.transfer is not None and estimate.transfer.raw_bytes == 20_000 * MODEL.kv_bytes_per_token


def test_explicit_uncached_count_wins_over_hashes() -> None:
    warm = region("d", cached_prefix_hashes=frozenset(hashes(100)))
    req = request(40_000, prefix_block_hashes=hashes(100), uncached_tokens={"d": 39_000})
    assert req.uncached_in(warm) == 39_000
    assert request(40_000, prefix_block_hashes=hashes(100)).uncached_in(warm) == 40_000 - 100 * 16


def test_a_prompt_of_whole_blocks_all_cached_still_computes_its_last_block() -> None:
    """A region reuses the blocks before the prompt's last token only (it computes that token's logits): 100
    whole blocks, all cached, leave the last block to compute and ship (before, 0: the split and its TTFT and
    WAN bytes were priced as free)."""
    warm = region("d", cached_prefix_hashes=frozenset(hashes(100)))
    assert request(1_600, prefix_block_hashes=hashes(100)).uncached_in(warm) == 16
    assert request(1_601, prefix_block_hashes=hashes(100)).uncached_in(warm) == 1


@pytest.mark.parametrize(
    ("codecs", "kwargs", "message"),
    [
        ([], {}, "at least one codec"),
        ([INT8], {}, "lossless"),
        ([RAW], {"min_streams": 4, "max_streams": 2}, "min_streams"),
        ([RAW], {"stream_window_bytes": 0}, "stream_window_bytes"),
    ],
)
def test_cost_model_refuses_unusable_settings(codecs: list[CodecOption], kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CostModel(codecs, **kwargs)


def test_a_long_fat_path_is_limited_by_the_stream_windows() -> None:
    # 100 Gbit/s at 200 ms: the bandwidth-delay product is 2.5 GB, 596 windows of 4 MiB, capped at 64 streams;
    # 64 x 4 MiB per 0.2 s = 1.34 GB/s on the wire, not the 12.5 GB/s free. 10 GB raw over 10 layers after a
    # 1 s prefill: the last byte lands 10e9 / 1.34e9 - 1 x 9/10 = 6.55 s after the prefill, + 0.1 s one way
    lnk = link("p", "d", bandwidth_gbps=100.0, utilization=0.0, rtt_ms=200.0)
    shape = ModelShape(name="m", num_layers=10, kv_bytes_per_token=1)
    plan = CostModel([RAW]).plan_transfer(request(), shape, lnk, 10**10, 1.0, 1e9)
    window_rate = 64 * 4 * 2**20 / 0.2
    assert plan.num_streams == 64
    assert plan.exposed_s == pytest.approx(10**10 / window_rate - 0.9 + 0.1)


def test_stream_windows_do_not_bind_when_the_streams_cover_the_path() -> None:
    # 8 Gbit/s at 40 ms: 40 MB in flight, 10 windows of 4 MiB carry it; the link's 1 GB/s is the limit
    assert _exposed(8.0, 10**9, 0.0, 1, rtt_ms=40.0) == pytest.approx(1.0 + 0.02)


def test_a_hybrid_models_recurrent_state_is_reserved_and_shipped_with_its_kv() -> None:
    # prfaas-1t's shape: 172 MiB of recurrent state per request, whatever its length. A decode region with
    # room for the 40,200 tokens' KV (659 MB at 16 KiB) but not for the state too is no candidate.
    state = 172 * 2**20
    hybrid = MODEL.model_copy(update={"kv_state_bytes": state})
    tokens_kv = (40_000 + 200) * MODEL.kv_bytes_per_token
    tight = fleet(regions={"dec-east": {"kv_buffer_free_bytes": tokens_kv + state // 2},
                           "dec-west": {"kv_buffer_free_bytes": tokens_kv + state}})  # fmt: skip
    decision = build_scheduler().decide(tight.model_copy(update={"model": hybrid}), request())
    assert decision.decode_region == "dec-west"  # dec-east is cheaper but cannot hold the state
    # a split ships the state with the 40,000 tokens' KV
    estimate = MODEL_3.split(request(), hybrid, region("p", Role.PREFILL), region("d"), link("p", "d"), 40_000, 40_000)
    assert estimate.transfer is not None and estimate.transfer.raw_bytes == 40_000 * MODEL.kv_bytes_per_token + state
