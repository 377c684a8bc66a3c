"""`prfaas tour`'s parts that need no deployment: the fleet view's closing rows (on the simulator's
small scenario), and the one-line refusal when nothing is up. The tour itself runs in test_up_down.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prfaas.cli.tour import fleet_view
from prfaas.devstack.tour import FLEET_POLICIES, fleet_command, fleet_rows


def test_the_fleet_rows_set_prfaas_beside_each_baseline_on_one_simulated_fleet() -> None:
    runs = fleet_view("small")
    rows = fleet_rows(runs)
    assert [r["policy"] for r in rows] == list(FLEET_POLICIES)
    ours = rows[0]
    assert ours["prfaas_throughput_x"] == ours["prfaas_ttft_p90_x"] == 1.0
    for row, run in zip(rows, runs, strict=True):
        assert row["throughput_at_slo_rps"] == run["throughput_at_slo_rps"] > 0
        assert row["prfaas_throughput_x"] == pytest.approx(ours["throughput_at_slo_rps"] / row["throughput_at_slo_rps"])
        assert row["prfaas_ttft_p90_x"] == pytest.approx(ours["ttft_p90_s"] / row["ttft_p90_s"])
        assert row["gpus"] == ours["gpus"]  # the baselines get the same number of GPUs


def test_the_printed_command_gives_the_same_rows(tmp_path: Path) -> None:
    command = fleet_command("small", 300)
    assert command.startswith("prfaas sim run --scenario small --requests 300 --policy prfaas ")
    argv = [sys.executable, "-m", "prfaas.cli.main", *command.split()[1:], "--json", str(tmp_path / "rows.json")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = json.loads((tmp_path / "rows.json").read_text())
    viewed = fleet_view("small", 300)
    assert [(r["policy"], r["throughput_at_slo_rps"]) for r in printed] == [
        (r["policy"], r["throughput_at_slo_rps"]) for r in viewed
    ]


def test_the_tour_without_a_deployment_says_what_to_run(tmp_path: Path) -> None:
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "prfaas.cli.main", "tour"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2
    assert done.stdout.strip() == (
        "error: nothing is up: run `prfaas up --model smollm2-135m --detach` first (make demo does)"
    )
