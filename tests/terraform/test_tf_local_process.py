"""terraform/modules/local_process (what region_local and control_plane_local are built on),
applied for real inside a loopback-only network namespace: a process that exits or never
becomes ready fails the apply and is not left running; destroy stops every process, with
SIGKILL for one that ignores SIGTERM, and removes the PID files."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from tf_kit import NETNS, REPO, have_terraform, in_netns, kill_all, netns_pids

pytestmark = pytest.mark.skipif(not have_terraform(), reason="needs terraform on PATH and root (ip netns)")

MODULE = REPO / "terraform" / "modules" / "local_process"


def _config(run_dir: Path, broken: bool) -> str:
    def module(name: str, command: list[str], ready: str = "", extra: str = "") -> str:
        argv = ", ".join(f'"{a}"' for a in command)
        return (
            f'module "{name}" {{\n  source = "{MODULE}"\n  name = "{name}"\n  run_dir = "{run_dir}"\n'
            f'  command = [{argv}]\n  ready_command = "{ready}"\n{extra}}}\n'
        )

    text = module("steady", ["sleep", "300"], ready="true")
    # ignores SIGTERM: destroy must fall back to SIGKILL of its whole group (sh and its sleep)
    text += module("stubborn", ["sh", "-c", "trap '' TERM; sleep 300"], ready="true", extra="  stop_timeout_s = 1\n")
    if broken:
        text += module("crashes", ["sh", "-c", "echo boom-on-start; exit 3"])
        text += module("never-ready", ["sleep", "300"], ready="false", extra="  ready_timeout_s = 2\n")
    return text


def test_failed_starts_fail_the_apply_and_destroy_stops_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    work = tmp_path / "tf"
    work.mkdir()
    ns = f"prfaas-tfp-{uuid.uuid4().hex[:8]}"
    subprocess.run([str(NETNS), "create", ns], check=True, timeout=30)
    try:
        (work / "main.tf").write_text(_config(run_dir, broken=False))
        in_netns(ns, ["terraform", "init", "-input=false", "-no-color"], work, timeout_s=60)
        in_netns(ns, ["terraform", "apply", "-auto-approve", "-input=false", "-no-color"], work, timeout_s=120)
        steady = int((run_dir / "steady.pid").read_text().split()[0])
        assert sorted(p.name for p in run_dir.glob("*.pid")) == ["steady.pid", "stubborn.pid"]

        (work / "main.tf").write_text(_config(run_dir, broken=True))
        in_netns(ns, ["terraform", "init", "-input=false", "-no-color"], work, timeout_s=60)
        with pytest.raises(AssertionError) as failed:
            in_netns(ns, ["terraform", "apply", "-auto-approve", "-input=false", "-no-color"], work, timeout_s=120)
        message = " ".join(str(failed.value).split())  # Terraform wraps long lines
        assert "crashes: exited during start" in message and "boom-on-start" in message, message
        assert "never-ready: not ready within 2s; stopping it" in message, message
        # the failed ones left nothing behind; the healthy ones were not touched
        assert sorted(p.name for p in run_dir.glob("*.pid")) == ["steady.pid", "stubborn.pid"]
        assert int((run_dir / "steady.pid").read_text().split()[0]) == steady
        assert len(netns_pids(ns)) == 3  # steady's sleep, stubborn's sh and its sleep

        destroyed = in_netns(ns, ["terraform", "destroy", "-auto-approve", "-input=false", "-no-color"], work)
        assert "stubborn: pid" in destroyed.stdout and "ignored SIGTERM for 1s; SIGKILL" in destroyed.stdout
        assert "steady: stopped pid" in destroyed.stdout
        assert netns_pids(ns) == []
        assert list(run_dir.glob("*.pid")) == []
    finally:
        kill_all(ns)
        subprocess.run([str(NETNS), "delete", ns], timeout=30)
