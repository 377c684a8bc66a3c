"""PrfaaS's analytic throughput model (sim/analytic.py): which requests it counts as split."""

from __future__ import annotations

import pytest

from prfaas.control_plane.scheduling import DisaggregationRule
from prfaas.sim.analytic import Lengths


def test_a_prompt_at_the_threshold_is_long_as_the_scheduler_splits_it() -> None:
    # the scheduler splits at uncached >= min_uncached_tokens, so of lengths 10, 20, 30 at a threshold of 20 two
    # split (p = 2/3, mean 25) and one stays local (mean 10); the model counted the 20 as short (p = 1/3)
    assert Lengths([30, 10, 20]).split(20) == pytest.approx((2 / 3, 25.0, 10.0))
    assert DisaggregationRule().min_uncached_tokens == 19_400 and Lengths([19_400]).split(19_400)[0] == 1.0


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [
        (0, (1.0, 20.0, None)),  # naive heterogeneous: everything splits
        (31, (0.0, None, 20.0)),  # above every length: nothing splits
        (None, (0.0, None, 20.0)),  # homogeneous: no split at all
    ],
)
def test_the_threshold_ends(threshold: int | None, expected: tuple[float, float | None, float | None]) -> None:
    assert Lengths([10, 20, 30]).split(threshold) == expected
