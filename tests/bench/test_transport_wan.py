"""bench/transport_wan.py: TLS over plaintext per configuration, where a configuration is the system,
profile, congestion control, stream count ("adaptive" for the adaptive channel, whatever count it
settled on) and codec. The adaptive channel used to share a key with 1 fixed stream (True == 1),
and the peers' rows with prfaas's."""

from __future__ import annotations

from typing import Any

import pytest
from bench_kit import python


def row(streams: int, adaptive: bool, tls: bool, effective: float, system: str | None = None) -> dict[str, Any]:
    out = {"profile": "continental", "cc": "cubic", "streams": streams, "adaptive": adaptive, "codec": "raw",
           "tls": tls, "status": "completed", "effective_ratio": effective, "cpu_s_per_gb": 1.0}  # fmt: skip
    return out if system is None else {**out, "system": system}


def tls_ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What transport_wan.tls_ratios returns and prints for `rows`."""
    return python(
        "import contextlib, io, json, sys\n"
        "from prfaas.bench.transport_wan import tls_ratios\n"
        "printed = io.StringIO()\n"
        "with contextlib.redirect_stdout(printed):\n"
        "    ratios = tls_ratios(json.load(sys.stdin))\n"
        "print(json.dumps({'ratios': ratios, 'lines': printed.getvalue().splitlines()}))\n",
        rows,
    )


def test_the_adaptive_channel_is_not_the_one_stream_configuration() -> None:
    got = tls_ratios([
        row(1, False, False, 0.30), row(1, False, True, 0.30),  # 1 fixed stream: TLS costs nothing
        row(4, True, False, 0.90), row(4, True, True, 0.45),  # adaptive (settled on 4): TLS halves it
    ])  # fmt: skip
    assert len(got["lines"]) == 2  # two configurations, two lines (one merged line before)
    ratios = {tuple(r["config"]): r["goodput_ratio"] for r in got["ratios"]}
    assert ratios == {
        ("prfaas", "continental", "cubic", 1, "raw"): pytest.approx(1.0),
        ("prfaas", "continental", "cubic", "adaptive", "raw"): pytest.approx(0.5),
    }


def test_a_peers_row_is_not_prfaass_plaintext_twin() -> None:
    # --peers: Mooncake's plaintext row has the same profile, cc, stream count and codec as prfaas's
    got = tls_ratios([
        row(8, False, False, 0.80, "prfaas"), row(8, False, True, 0.40, "prfaas"),
        row(8, False, False, 0.10, "mooncake"),
    ])  # fmt: skip
    assert [(r["config"][0], r["goodput_ratio"]) for r in got["ratios"]] == [("prfaas", pytest.approx(0.5))]
    assert (got["ratios"][0]["runs_tls"], got["ratios"][0]["runs_plain"]) == (1, 1)
