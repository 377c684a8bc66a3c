"""bench/control_plane.py: its argument checks (before any process starts; --block 0 used to loop
forever, --rate 0 divide by zero, --count 0 index an empty list) and its percentiles, loadgen's
(linear interpolation between closest ranks, like every bench's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_kit import python, script, unusable_home


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block", "0"], "--block 0: at least 1"),
        (["--count", "0"], "--count 0: at least 1"),
        (["--rate", "0"], "--rate 0.0: requests/s above 0"),
        (["--rate", "100", "-5"], "--rate -5.0: requests/s above 0"),  # one bad rate of several
    ],
)
def test_nothing_to_measure_is_a_usage_error(tmp_path: Path, args: list[str], message: str) -> None:
    done = script("control_plane.py", *args, env=unusable_home(tmp_path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr


CASES = [  # (samples, q, expected)
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # halfway between the two middle ones (nearest rank said 3.0)
    ([10.0, 20.0], 99, 19.9),  # 99 % of the way from 10 to 20
    ([5.0], 99, 5.0),  # one sample is every percentile
    ([3.0, 1.0, 2.0], 0, 1.0),  # unsorted in, the smallest at P0
]


def test_percentiles_are_loadgens_linear_interpolation() -> None:
    got = python(
        "import json, sys\n"
        "from prfaas.bench import control_plane\n"
        "print(json.dumps([control_plane.percentile(s, q) for s, q, _ in json.load(sys.stdin)]))\n",
        CASES,
    )
    assert got == pytest.approx([expected for _, _, expected in CASES])
