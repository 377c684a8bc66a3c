"""bench/sim_calibrate.py: a threshold its probes cannot fit both prefill lines at is a usage error before anything
starts (it failed in `timings_from`, "need at least three samples", after ~2 min of probing the real stack)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_kit import script, unusable_home

# the probes: 4, 128, 384 | 640, 900, 1000, 1500, 2000 | 2500, 3000 tokens; each side of the threshold needs 3 sizes
REFUSED = "need three sizes on each side of the threshold"


@pytest.mark.parametrize("split", ["384", "300", "2001", "2500"])
def test_a_threshold_with_under_three_probe_sizes_on_a_side_is_a_usage_error(tmp_path: Path, split: str) -> None:
    done = script("sim_calibrate.py", "--split-tokens", split, env=unusable_home(tmp_path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--split-tokens {split}: " in done.stderr and "pick one in (384, 2000]" in done.stderr


@pytest.mark.parametrize("split", ["385", "2000"])
def test_a_threshold_with_three_probe_sizes_each_side_goes_on(tmp_path: Path, split: str) -> None:
    # past the check, the unusable PRFAAS_HOME stops it at the model download, before any process starts
    done = script("sim_calibrate.py", "--split-tokens", split, env=unusable_home(tmp_path))
    assert done.returncode != 0 and REFUSED not in done.stderr, done.stderr[-2000:]
