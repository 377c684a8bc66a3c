"""What the dashboard pages compute (control_plane/dashboard/data.py), without a browser."""

from __future__ import annotations

import pytest

from prfaas.control_plane.dashboard.data import percentile


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([], 50, None), ([3.0], 99, 3.0), ([1, 2, 3, 4], 50, 2), ([1, 2, 3, 4], 90, 4), (list(range(1, 101)), 99, 99)],
)
def test_percentile_nearest_rank(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected
