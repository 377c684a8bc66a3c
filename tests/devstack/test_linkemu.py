"""The userspace WAN emulator (devstack/linkemu) and how devstack starts it (devstack/netns.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from prfaas.devstack.netns import add_namespace, build_linkemu, ip, remove_namespaces, start_linkemu


@pytest.mark.parametrize(
    "args",
    [["--rate-mbit", "inf"], ["--delay-ms", "nan"], ["--delay-ms", "-5"], ["--rate-mbit", "2x0"],
     ["--arena-mb", "17592186044416"], ["--loss-pct", "101"]],
)  # fmt: skip
def test_numbers_it_cannot_emulate_are_refused_at_start(args: list[str]) -> None:
    """Each of these started before: inf made a dead link, nan released nothing, -5 ms was 0 ms, "2x0" was
    2 Mbit/s, and a huge arena overflowed to 0 bytes (a divide error at the first packet)."""
    done = subprocess.run([str(build_linkemu()), "--tun-a", "x", "--tun-b", "y", *args], capture_output=True,
                          text=True, timeout=10)  # fmt: skip
    assert done.returncode == 2 and f"{args[0]} {args[1]}: a number in" in done.stderr


def test_a_warning_before_ready_in_the_log_file_does_not_fail_the_start(tmp_path: Path) -> None:
    """Without CAP_SYS_NICE the emulator warns (setpriority) before `ready`, into the same log file."""
    script = "echo 'setpriority: Permission denied' >&2; echo ready tun_a=a tun_b=b; exec sleep 30"
    proc = start_linkemu(["sh", "-c", script], log=tmp_path / "linkemu.log")
    try:
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_an_interrupt_while_it_starts_stops_it(tmp_path: Path) -> None:
    """The emulator runs in a session of its own (a terminal's Ctrl-C does not reach it): interrupted while
    we wait for its `ready`, we stop it, or it and its TUN devices outlive us."""
    pid_file = tmp_path / "pid"
    script = f"echo $$ > {pid_file}; exec sleep 30"
    main = threading.main_thread().ident
    assert main is not None
    threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        start_linkemu(["sh", "-c", script])
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="TUN devices and namespaces need root")
def test_it_stops_when_a_tun_device_is_gone_instead_of_spinning() -> None:
    """Its TUN device deleted (its namespace removed), ppoll returns POLLERR at once forever: it spun a core
    at 80-100 %. It stops instead."""
    tag = f"lkt{os.getpid() % 100000}"
    namespace = f"{tag}-ns"
    proc = None
    try:
        add_namespace(namespace)
        proc = start_linkemu([str(build_linkemu()), "--tun-a", f"{tag}a", "--tun-b", f"{tag}b"])
        ip("link", "set", f"{tag}a", "netns", namespace)
        remove_namespaces([namespace])
        proc.wait(5)
        assert proc.returncode == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        remove_namespaces([namespace], [f"{tag}a", f"{tag}b"])
