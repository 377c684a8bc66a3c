"""bench/api_floor.py's argument checks, before the decode region starts (--count 0 used to divide by
zero after a run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_kit import script, unusable_home


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--count", "0"], "--count 0: at least 1"),
        (["--rounds", "0"], "--rounds 0: at least 1"),
        (["--rate", "0"], "--rate 0.0: requests/s above 0"),
    ],
)
def test_nothing_to_measure_is_a_usage_error(tmp_path: Path, args: list[str], message: str) -> None:
    done = script("api_floor.py", *args, env=unusable_home(tmp_path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr
