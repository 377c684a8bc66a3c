"""Calibration mode: measured timings in, a predicted TTFT out, compared with a measured trace."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from prfaas.sim.calibration import (
    MeasuredWorker,
    Prediction,
    PrefillFit,
    fit_line,
    fit_prefill,
    load_timings,
    measured_ttfts,
    predict,
    predict_trace,
)
from prfaas.sim.workload import Arrival

TIMINGS: dict[str, Any] = {
    "version": 1,
    "model": {"name": "tiny", "num_layers": 4, "kv_bytes_per_token": 1024},
    "regions": [
        {"name": "pf", "role": "prefill", "num_prefill_workers": 1, "usd_per_gpu_hour": 0.5,
         "prefill": {"base_s": 0.01, "per_token_s": 0.0005}},
        {"name": "pd", "role": "both", "num_prefill_workers": 1, "num_decode_workers": 1, "usd_per_gpu_hour": 4.0,
         "prefill": {"base_s": 0.02, "per_token_s": 0.001}, "decode": {"base_s": 0.0, "per_seq_s": 0.01}},
    ],
    "links": [{"src": "pf", "dst": "pd", "bandwidth_gbps": 10.0, "rtt_ms": 2.0}],
    "overhead_s": 0.05,
    "min_uncached_tokens": 1000,
}  # fmt: skip


def _write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "timings.json"
    path.write_text(json.dumps(doc))
    return path


def test_an_isolated_local_request_takes_overhead_plus_prefill(tmp_path: Path) -> None:
    timings = load_timings(_write(tmp_path, TIMINGS))
    # 200 tokens < threshold: local in pd. 0.05 overhead + (0.02 + 0.2) prefill; the first token is the prefill's
    prediction = predict(timings, [Arrival(0.0, 200, 4)])
    assert prediction.num_split == 0
    assert prediction.predicted_ttft_p50_s == pytest.approx(0.05 + 0.22)


def test_an_isolated_long_request_splits_and_pays_its_prefill_and_the_last_layer(tmp_path: Path) -> None:
    timings = load_timings(_write(tmp_path, TIMINGS))
    # 2000 tokens: split via pf (cheaper). 0.05 + (0.01 + 1.0) prefill + the last of 4 layers of the KV
    # (2000 x 1024 B, the default policy's lossless codec: / 1.47) at 1.25e9 B/s + RTT/2 (0.001)
    prediction = predict(timings, [Arrival(0.0, 2000, 4)])
    assert prediction.num_split == 1
    assert prediction.predicted_ttft_p50_s == pytest.approx(0.05 + 1.01 + _last_layer_s(2000) + 0.001)


def _last_layer_s(tokens: int) -> float:
    return math.ceil(tokens * 1024 / 1.47) / 4 / 1.25e9


@pytest.mark.parametrize(("slots", "wait_s"), [("shared", 0.02), ("separate", 0.0)])
def test_a_local_request_waits_for_a_split_decoding_in_a_shared_slot(tmp_path: Path, slots: str, wait_s: float) -> None:
    # the split's first token at t1; its 3 more tokens take 3 steps of 10 ms on pd's one slot. A local request placed
    # at t1 + 0.01 waits for them (until t1 + 0.03) when prefill and decode share the slot (the local decode region)
    doc = json.loads(json.dumps(TIMINGS))
    doc["regions"][1]["engine_slots"] = slots
    timings = load_timings(_write(tmp_path, doc))
    t1 = 0.05 + 1.01 + _last_layer_s(2000) + 0.001
    prediction = predict(timings, [Arrival(0.0, 2000, 4), Arrival(t1 - 0.04, 200, 4)])
    assert prediction.num_split == 1
    assert prediction.predicted_ttft_p50_s == pytest.approx(0.05 + 0.22 + wait_s)  # P50 of two: the local one


def test_prediction_is_compared_with_the_measured_ttft_of_the_trace(tmp_path: Path) -> None:
    timings = _write(tmp_path, TIMINGS)
    trace = tmp_path / "measured.jsonl"
    rows = [{"t_s": 10.0 * i, "prompt_tokens": 200, "output_tokens": 4, "ttft_s": 0.35} for i in range(5)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert measured_ttfts(trace) == [0.35] * 5
    prediction = predict_trace(timings, trace)
    assert prediction.measured_ttft_p50_s == 0.35
    assert prediction.error == pytest.approx(0.27 / 0.35 - 1)


def test_requests_queue_for_the_measured_workers(tmp_path: Path) -> None:
    timings = load_timings(_write(tmp_path, TIMINGS))
    # two local requests at once on one prefill worker: the second waits for the first's 0.22 s
    prediction = predict(timings, [Arrival(0.0, 200, 1), Arrival(0.0, 200, 1)])
    assert prediction.predicted_ttft_p90_s == pytest.approx(0.05 + 0.44)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"overhead_s": -1}, "overhead_s"),
        ({"version": 2}, "version"),
        ({"regions": []}, "regions"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_timings_are_refused_naming_the_field(tmp_path: Path, patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_timings(_write(tmp_path, TIMINGS | patch))


def _region_patch(index: int, **fields: Any) -> list[dict[str, Any]]:
    regions = [dict(r) for r in TIMINGS["regions"]]
    regions[index] |= fields
    return regions


_PD_NO_DECODE_FIT = {k: v for k, v in TIMINGS["regions"][1].items() if k != "decode"}


@pytest.mark.parametrize(
    ("regions", "message"),
    [
        # a decoding region without its decode fit ran every step at a made-up 1 s (TTFTs ~50x the measured)
        ([TIMINGS["regions"][0], _PD_NO_DECODE_FIT], "regions.1: .*needs its decode fit"),
        # a prefill of no time: its rate divided by zero (ZeroDivisionError deep in the simulation)
        (_region_patch(0, prefill={"base_s": 0, "per_token_s": 0}), "regions.0.prefill: .*a prefill takes time"),
        # nothing decodes: every request was rejected, a prediction of inf with no error
        (_region_patch(1, num_decode_workers=0, engine_slots="separate"), "no region decodes"),
    ],
)
def test_timings_no_deployment_could_have_are_refused(
    tmp_path: Path, regions: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_timings(_write(tmp_path, TIMINGS | {"regions": regions}))


def test_a_prefill_fit_of_the_quadratic_term_alone_is_a_time() -> None:
    # fit_prefill drops the terms that come out negative: n^2 alone is still a prefill that takes time
    assert MeasuredWorker(PrefillFit(base_s=0, per_token_s=0, per_token_ctx_s=1e-9), None, 1).prefill_s(1000) > 0


def test_fits_recover_known_lines() -> None:
    assert fit_line([0, 1, 2], [1.0, 3.0, 5.0]) == pytest.approx((1.0, 2.0))
    sizes = [4, 64, 256, 1024, 2048]
    fit = fit_prefill(sizes, [0.02 + 1e-4 * n + 1e-7 * n * n / 2 for n in sizes])
    assert (fit.base_s, fit.per_token_s, fit.per_token_ctx_s) == pytest.approx((0.02, 1e-4, 1e-7))
    worker = MeasuredWorker(PrefillFit(base_s=0.02, per_token_s=1e-4, per_token_ctx_s=1e-7), None, 1)
    assert worker.prefill_s(1000) == pytest.approx(0.02 + 0.1 + 1e-7 * 1000 * 500)


def test_cli_calibrate_prints_the_prediction_beside_the_measurement(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from prfaas.cli.main import app

    timings = _write(tmp_path, TIMINGS)
    trace = tmp_path / "measured.jsonl"
    trace.write_text(json.dumps({"t_s": 0.0, "prompt_tokens": 200, "output_tokens": 4, "ttft_s": 0.27}) + "\n")
    out = tmp_path / "prediction.json"
    args = ["sim", "calibrate", "--timings", str(timings), "--trace", str(trace), "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "predicted 270.0 ms, measured 270.0 ms, error +0.0%" in result.output
    assert json.loads(out.read_text())["num_requests"] == 1
    missing = CliRunner().invoke(app, ["sim", "calibrate", "--timings", str(timings), "--trace", str(tmp_path / "no")])
    assert missing.exit_code == 2 and "error:" in missing.output


def _cli_calibrate(tmp_path: Path, rows: list[dict[str, Any]]) -> tuple[Any, Path]:
    from typer.testing import CliRunner

    from prfaas.cli.main import app

    trace = tmp_path / "measured.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "prediction.json"
    args = ["sim", "calibrate", "--timings", str(_write(tmp_path, TIMINGS)), "--trace", str(trace), "--json", str(out)]
    return CliRunner().invoke(app, args), out


def test_predicted_and_measured_ttft_are_over_the_same_requests(tmp_path: Path) -> None:
    # 2M prompt tokens of 1 KiB each fill no 1 GiB KV buffer: the simulation rejects the request the run measured
    # at 5 s. The measured P90 was over all three (5 s), the predicted over the two it served (0.27 s). The file is
    # out of order: its rows pair with the arrivals as load_trace replays them, by t_s
    rows = [{"t_s": 20.0, "prompt_tokens": 2_000_000, "output_tokens": 4, "ttft_s": 5.0}]
    rows += [{"t_s": 10.0 * i, "prompt_tokens": 200, "output_tokens": 4, "ttft_s": 0.3} for i in range(2)]
    result, out = _cli_calibrate(tmp_path, rows)
    assert result.exit_code == 0, result.output
    assert "3 requests in the simulation: 2 completed (0 split), 1 rejected (capacity: 1)" in result.output
    assert "TTFT P90: predicted 270.0 ms, measured 300.0 ms" in result.output
    doc = json.loads(out.read_text())
    assert (doc["num_completed"], doc["num_rejected"], doc["num_compared"]) == (2, 1, 2)


def test_a_trace_the_simulation_serves_none_of_is_an_error_not_infinity(tmp_path: Path) -> None:
    # every request rejected: the percentiles of nothing were inf, printed "inf ms" and written as `Infinity`
    rows = [{"t_s": 1.0 * i, "prompt_tokens": 2_000_000, "output_tokens": 4, "ttft_s": 0.02} for i in range(3)]
    result, out = _cli_calibrate(tmp_path, rows)
    assert result.exit_code == 2, result.output
    assert "0 completed (0 split), 3 rejected (capacity: 3)" in result.output
    assert "error: no TTFT to predict: none of the 3 requests completed in the simulation" in result.output
    assert "inf" not in result.output and not out.exists()


def test_the_json_prediction_is_strict_json() -> None:
    row = Prediction(1, 0, 1, {"capacity": 1}, 0, 0, math.inf, None, 0.02, 0.02).as_row()
    assert row["predicted_ttft_p50_s"] is None and json.loads(json.dumps(row, allow_nan=False)) == row
