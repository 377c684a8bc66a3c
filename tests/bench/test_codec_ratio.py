"""bench/codec_ratio.py's argument checks: a count that leaves nothing to time is refused before the
model loads (it used to load it, then divide by zero)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_kit import script, unusable_home


@pytest.mark.parametrize(("flag", "value"), [("--repeat", "0"), ("--tokens", "0")])
def test_a_count_under_one_is_a_usage_error(tmp_path: Path, flag: str, value: str) -> None:
    done = script("codec_ratio.py", flag, value, env=unusable_home(tmp_path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{flag} {value}: at least 1" in done.stderr
