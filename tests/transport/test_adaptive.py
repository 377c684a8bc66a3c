"""The stream-count policy against modelled paths (pure: no sockets)."""

import pytest

from prfaas.transport.adaptive import StreamController


def drive(controller: StreamController, path_rate: object, windows: int = 40) -> list[int]:
    counts = []
    for t in range(windows):
        n = controller.current
        controller.update(float(t), path_rate(n), backlogged=True)  # type: ignore[operator]
        counts.append(controller.current)
    return counts


@pytest.mark.parametrize(
    ("per_stream", "capacity", "expected"),
    [
        # clean short path: 4 streams already fill 37.5 MB/s; doubling to 8 gains nothing -> back to 4
        (20e6, 37.5e6, 4),
        # lossy long path: each CUBIC stream gets ~0.9 MB/s; the pipe fills near 42 streams, so the
        # climb goes 4 -> 8 -> 16 -> 32 (each +100 %) -> 64 (+17 %, above the 5 % bar) -> settles at 64
        (0.9e6, 37.5e6, 64),
        # medium: 3 MB/s each fills at 12.5; 16 gains +33 % over 8 (>= 5 %), 32 gains 0 -> 16
        (3e6, 37.5e6, 16),
    ],
)
def test_climbs_to_the_count_that_fills_the_path(per_stream: float, capacity: float, expected: int) -> None:
    counts = drive(StreamController(hold_intervals=1000), lambda n: min(n * per_stream, capacity))
    assert counts[-1] == expected


def test_producer_limited_windows_do_not_move_the_count() -> None:
    controller = StreamController()
    for t in range(10):
        controller.update(float(t), 1e3, backlogged=False)
    assert controller.current == 4


def test_probes_again_after_holding_and_follows_a_path_that_improved() -> None:
    controller = StreamController(hold_intervals=5)
    capacity = [37.5e6]
    assert drive(controller, lambda n: min(n * 20e6, capacity[0]), windows=6)[-1] == 4
    capacity[0] = 150e6  # the link got faster
    counts = drive(controller, lambda n: min(n * 20e6, capacity[0]), windows=30)
    settled = max(set(counts[-20:]), key=counts[-20:].count)  # brief re-probes aside
    assert settled == 8


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="min_streams <= initial <= max_streams"):
        StreamController(initial=128, max_streams=64)
