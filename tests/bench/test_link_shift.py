"""bench/link_shift.py's report: TTFT P90s with loadgen's percentile (linear interpolation; it used
statistics.quantiles' exclusive method), over the requests that streamed a token, with the requests
that did not counted beside them; and no TTFT made up for a stream that ended without text."""

from __future__ import annotations

from typing import Any

import pytest
from bench_kit import python


def summarize(requests: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return python(
        "import json, sys\n"
        "from prfaas.bench.link_shift import summarize\n"
        "runs = {mode: {'requests': rows, 'links': []} for mode, rows in json.load(sys.stdin).items()}\n"
        "print(json.dumps({k: v for k, v in summarize(runs, 20.0).items() if k != 'runs'}))\n",
        requests,
    )


def request(index: int, **fields: Any) -> dict[str, Any]:
    return {"index": index, "start_s": float(index), "slowed": None, "placement": "split",
            "prefill_region": "pre-a", **fields}  # fmt: skip


def test_the_p90_interpolates_and_the_requests_without_a_ttft_are_counted_beside_it() -> None:
    measured = [request(i, ttft_s=float(i + 1)) for i in range(10)]  # TTFTs 1..10 s
    measured += [request(10, error="APITimeoutError: timed out"), request(11, no_text=True)]
    got = summarize({"measured": measured, "static": [request(0, ttft_s=2.0), request(1, ttft_s=4.0)]})
    assert got["ttft_p90_measured_s"] == pytest.approx(9.1)  # 90 % of the way from 1 to 10 (exclusive: 9.9)
    assert got["ttft_p90_static_s"] == pytest.approx(3.8)  # two samples: 2 + 0.9 * 2 (exclusive: 4.0)
    assert got["ttft_failed"]["measured"] == {"count": 2, "share": pytest.approx(2 / 12), "requests": 12,
                                              "no_text": 1, "errors": 1}  # fmt: skip
    assert got["ttft_failed"]["static"]["count"] == 0


def test_a_stream_without_text_gets_no_ttft() -> None:
    got = python(
        "import json, types\n"
        "from prfaas.bench.link_shift import _one\n"
        "def chunk(text):\n"
        "    return types.SimpleNamespace(id='job-1', choices=[types.SimpleNamespace(text=text)])\n"
        "client = types.SimpleNamespace(completions=types.SimpleNamespace(create=lambda **_: iter([chunk(''), "
        "chunk('')])))\n"
        "row = {}\n"
        "_one(client, [1, 2, 3], row)\n"
        "print(json.dumps(row))\n",
    )
    assert "ttft_s" not in got
    assert got["no_text"] is True
    assert got["job_id"] == "job-1"
