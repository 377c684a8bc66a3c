"""How `prfaas tour` ends: "`make demo` stops the deployment now" only under `make demo` (which passes the
hidden `--down-after` and runs `prfaas down` next); run on its own, the deployment stays up and the tour
says so. Before, a tour run on its own said `make demo` stopped it, and nothing did. The tour runs in
process, its deployment, completions and bench stubbed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prfaas.cli.main import app
from prfaas.devstack.state import UpState
from prfaas.devstack.tour import Completion


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """A deployment `up` wrote, two identical completions; the bench arguments the tour passed."""
    import prfaas.cli.tour as tour
    import prfaas.devstack.state as state
    import prfaas.devstack.tour as logic
    import prfaas.loadgen.client as client

    up = UpState(api_base="http://127.0.0.1:9/v1", api_key="pfk-x", admin_key="a", dashboard_url="http://d",
                 url="http://127.0.0.1:9", tenant_id="t", topology="", redis_url="", key_prefix="p", registry="",
                 log_dir="", emulate_wan=False)  # fmt: skip
    monkeypatch.setattr(state, "read_state", lambda _home: up)
    monkeypatch.setattr(client, "fetch_models", lambda *_: ["m"])
    split = {"id": "j-1", "prefill_region": "pre", "decode_region": "dec"}
    local = {"id": "j-2", "prefill_region": "dec", "decode_region": "dec"}
    pair = (Completion("split", "Paris.", 1.0, split), Completion("local", "Paris.", 1.0, local))
    monkeypatch.setattr(logic, "completion_pair", lambda *_, **__: pair)
    monkeypatch.setattr(tour, "_split_trace", lambda *_: [])
    benched: list[list[str]] = []
    monkeypatch.setattr(tour, "_bench", benched.append)
    return benched


def _tour(tmp_path: Path, *args: str) -> str:
    done = CliRunner().invoke(app, ["tour", "--no-fleet", *args], env={"PRFAAS_HOME": str(tmp_path), "COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    return re.sub(r"\s+", " ", done.output)


def test_the_tour_on_its_own_says_the_deployment_stays_up(tmp_path: Path, stubbed: list[list[str]]) -> None:
    output = _tour(tmp_path)
    assert stubbed and "make demo" not in output.split("Yours to explore")[1], output
    assert "The deployment stays up: `prfaas down` stops it, and `prfaas up --model smollm2-135m` brings it back" in (
        output
    )


def test_under_make_demo_the_tour_says_make_demo_stops_it(tmp_path: Path, stubbed: list[list[str]]) -> None:
    output = _tour(tmp_path, "--down-after")
    assert "`make demo` stops the deployment now; `prfaas up --model smollm2-135m` brings it back" in output
    assert "--down-after" in Path("Makefile").read_text().split("\ndemo:")[1].split("\n\n")[0]
