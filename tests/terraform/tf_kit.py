"""Terraform run offline for the tests: every command inside a network namespace with only
loopback (terraform/netns.sh), CHECKPOINT_DISABLE=1, a CLI config without provider sources."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NETNS = REPO / "terraform" / "netns.sh"


def have_terraform() -> bool:
    return shutil.which("terraform") is not None and os.geteuid() == 0 and shutil.which("ip") is not None


def copy_tree(dest: Path) -> Path:
    """terraform/ without state, caches or run folders (the tests never write in the repo)."""
    ignore = shutil.ignore_patterns(".terraform", "*.tfstate*", ".run", ".terraform.lock.hcl")
    shutil.copytree(REPO / "terraform", dest, ignore=ignore)
    return dest


def in_netns(
    ns: str,
    args: Sequence[str],
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `args` inside namespace `ns`; raises AssertionError with the output when it fails."""
    proc = subprocess.run(
        [str(NETNS), "exec", ns, *args], cwd=cwd, env=dict(os.environ) | dict(env or {}), input=stdin,
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
    return [int(p) for p in out.split()]


def kill_all(ns: str, timeout_s: float = 10) -> list[int]:
    """SIGKILL whatever still runs in `ns` (only processes the test started live there) and
    wait until they are gone; returns the PIDs that were found."""
    found = netns_pids(ns)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while netns_pids(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found
