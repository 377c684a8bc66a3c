"""bench/chaos.py: options that would send nothing are refused before the model generates the expected
texts and the deployment starts (`--rate 0`, `--prompts 0` raised ZeroDivisionError after both; a negative
rate planned every request and fault at once); `wall_s` is measured on the monotonic clock."""

from __future__ import annotations

import pytest
from bench_kit import python, usage_outcomes

CASES = [
    (["--rate", "0"], "argument --rate: must be a positive number, not 0"),
    (["--rate", "-2"], "argument --rate: must be a positive number, not -2"),
    (["--prompts", "0"], "argument --prompts: at least 1, not 0"),
    (["--requests", "0"], "argument --requests: at least 1, not 0"),
    (["--deadline-s", "0"], "argument --deadline-s: must be a positive number, not 0"),
    (["--max-tokens", "0"], "argument --max-tokens: at least 1, not 0"),
]


@pytest.fixture(scope="module")
def usage() -> dict[str, list[object]]:
    return usage_outcomes("chaos", [args for args, _ in CASES])


@pytest.mark.parametrize(("args", "message"), CASES)
def test_options_that_send_nothing_are_usage_errors(
    usage: dict[str, list[object]], args: list[str], message: str
) -> None:
    code, stderr = usage[" ".join(args)]
    assert code == 2, stderr
    assert message in str(stderr)


# chaos.main with the model, the deployment and the load stubbed; the wall clock steps back an hour (NTP)
# while the load runs for 0.2 s. `tally` records the wall_s it is given.
CLOCK_STEP = """
import json, sys, time, types
import prfaas.bench.chaos as chaos

class Deployment:
    state = types.SimpleNamespace(api_base="x", api_key="k", tenant_id="t", emulate_wan=False)
    def start(self): return self.state
    def stop(self): pass

class Tallied(Exception):
    pass

def tally(*args):
    got.append(args[-1])
    raise Tallied

real_time, offset, got = time.time, [0.0], []
time.time = lambda: real_time() + offset[0]

def run(*args, **kwargs):
    time.sleep(0.2)
    offset[0] = -3600.0

chaos.HFEngine = lambda m: types.SimpleNamespace(encode=lambda t: list(range(5000)), generate=lambda p, s: [1],
                                                 decode_text=lambda ids: "x")
chaos.fresh_deployment = lambda *args, **kwargs: Deployment()
chaos.steady.run = run
chaos.Faults.finish = lambda self: None
chaos.tally = tally
sys.argv = ["chaos.py", "--requests", "4"]
try:
    chaos.main()
except Tallied:
    pass
print(json.dumps(got))
"""


def test_wall_s_is_the_runs_length_whatever_the_wall_clock_does() -> None:
    (wall_s,) = python(CLOCK_STEP)
    assert 0.15 < wall_s < 5.0  # before: about -3599.8 s
