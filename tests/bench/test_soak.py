"""bench/soak.py: a soak that sends no load, or measures no memory, does not pass. `--rate 0`, a negative
rate, `--minutes 0` used to plan no request, take no RSS sample and exit 0 (`all([])` is True); now they
are usage errors before the model loads, and a run that took no sample exits 1."""

from __future__ import annotations

import pytest
from bench_kit import python, usage_outcomes

CASES = [
    (["--rate", "0"], "argument --rate: must be a positive number, not 0"),
    (["--rate", "-3"], "argument --rate: must be a positive number, not -3"),
    (["--rate", "nan"], "argument --rate: must be a positive number, not nan"),
    (["--minutes", "0"], "argument --minutes: must be a positive number, not 0"),
    (["--minutes", "0.001"], "--minutes 0.001 at --rate 2 is not one request"),  # 0.12 requests
    (["--max-tokens", "0"], "argument --max-tokens: at least 1, not 0"),
]


@pytest.fixture(scope="module")
def usage() -> dict[str, list[object]]:
    return usage_outcomes("soak", [args for args, _ in CASES])


@pytest.mark.parametrize(("args", "message"), CASES)
def test_options_that_send_no_load_are_usage_errors(
    usage: dict[str, list[object]], args: list[str], message: str
) -> None:
    code, stderr = usage[" ".join(args)]
    assert code == 2, stderr
    assert message in str(stderr)


# soak.main with everything around it stubbed: the model, the deployment (no process: no RSS sample), Redis (the
# same keys before and after), the waits; every request "finished". Only the verdict is soak.py's own.
NO_SAMPLES = """
import json, sys, types
import prfaas.bench.soak as soak

class Deployment:
    procs = {}
    state = types.SimpleNamespace(redis_url="redis://x", key_prefix="p", api_base="http://127.0.0.1:9/v1", api_key="k")
    def start(self): return self.state
    def stop(self): pass

def run(api_base, api_key, model, asked, **kwargs):
    for a in asked:
        a.finished = True

soak.HFEngine = lambda model: types.SimpleNamespace(encode=lambda text: list(range(10000)))
soak.fresh_deployment = lambda *args, **kwargs: Deployment()
soak.Keys = lambda url, prefix: types.SimpleNamespace(names=lambda: {"a", "b"})
soak.steady.run = run
soak.time.sleep = lambda s: None
sys.argv = ["soak.py", "--minutes", "0.05", "--rate", "2"]
print(json.dumps(soak.main()))
"""


def test_a_soak_that_took_no_memory_sample_fails() -> None:
    assert python(NO_SAMPLES) == 1  # 6 requests, all finished, keys unchanged: it passed with no RSS measured
