"""Network namespaces and the userspace WAN link emulator (needs root): what both the emulated
WAN of `prfaas up --emulate-wan` (`network.WanMesh`) and the benches' two-namespace link
(`wanlink.wan_link`) are built from.

The kernel here has no `netem`, so `linkemu/` (C, built on first use) plays the link: it
creates two TUN devices in the root namespace and forwards IP packets between them with a
one-way delay, a rate limit and random loss per direction. Each TUN device is then moved
into its namespace (the emulator's open descriptors keep working), renamed and addressed.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

LINKEMU_DIR = Path(__file__).resolve().parent / "linkemu"
LINKEMU_BIN = LINKEMU_DIR / "build" / "linkemu"
START_TIMEOUT_S = 10.0  # linkemu prints `ready` once both TUN devices exist


def build_linkemu() -> Path:
    """Compile the emulator if needed (linkemu/build.sh is idempotent)."""
    subprocess.run(["sh", str(LINKEMU_DIR / "build.sh")], check=True, stdout=subprocess.DEVNULL, timeout=120)
    return LINKEMU_BIN


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`ip ARGS`; OSError with its message unless it succeeds (or `check` is false)."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if check and out.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def add_namespace(name: str, sysctls: Mapping[str, str] | None = None) -> None:
    """A new namespace `name` with its loopback up and `sysctls` set in it."""
    ip("netns", "add", name)
    try:  # a namespace half set up is removed here: the caller records only one that exists whole
        ip("-n", name, "link", "set", "lo", "up")
        for key, value in (sysctls or {}).items():
            done = subprocess.run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", f"{key}={value}"],
                                  capture_output=True, text=True, timeout=10, check=False)  # fmt: skip
            if done.returncode != 0:
                raise OSError(f"sysctl {key}={value} in {name}: {done.stderr.strip()}")
    except BaseException:
        ip("netns", "del", name, check=False)
        raise


def linkemu_argv(
    tun_a: str,
    tun_b: str,
    *,
    rtt_ms: float,
    rate_mbit: float,
    loss_pct: float,
    seed: int = 1,
    queue_bytes: int | None = None,
    nice: int = 0,
    rt_prio: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The emulator's command line: `rtt_ms` split evenly between the directions; rate 0 is
    unlimited; queue None is linkemu's default (1.5 x BDP); `extra` as linkemu takes it."""
    argv = [str(build_linkemu()), "--tun-a", tun_a, "--tun-b", tun_b, "--delay-ms", str(rtt_ms / 2),
            "--rate-mbit", str(rate_mbit), "--loss-pct", str(loss_pct), "--seed", str(seed)]  # fmt: skip
    if queue_bytes is not None:
        argv += ["--queue-bytes", str(queue_bytes)]
    if nice:
        argv += ["--nice", str(nice)]
    if rt_prio:
        argv += ["--rt-prio", str(rt_prio)]
    return argv + list(extra)


def start_linkemu(
    argv: list[str], log: Path | None = None, on_spawn: Callable[[int], None] | None = None
) -> subprocess.Popen[str]:
    """Start the emulator in a session of its own (a terminal's Ctrl-C reaches only us, and
    we stop it in order) and wait for its `ready` line: on a pipe (its counters can then be
    read, `wanlink.WanLink.counters`), or in the file `log` for one that outlives us.
    `on_spawn(pid)` runs as soon as it exists, before the wait (a caller records its group)."""
    if log is None:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
    else:
        with log.open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:  # from here on the emulator is ours to stop: a Ctrl-C while it starts must not leave it running
        if on_spawn is not None:
            on_spawn(proc.pid)
        if log is None:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
            text = proc.stdout.readline() if ready else ""
        else:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _ready(log.read_text()) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            text = log.read_text()  # a warning (a nice level refused) may come before `ready` in the file
        if not _ready(text):
            detail = proc.stderr.read() if log is None and proc.stderr is not None and proc.poll() is not None else ""
            raise OSError(f"linkemu did not start: {text!r} {detail!r}")
    except BaseException:
        stop(proc)
        raise
    return proc


def _ready(text: str) -> bool:
    return any(line.startswith("ready") for line in text.splitlines())


def attach_tun(tun: str, namespace: str, name: str, address: str, *, mtu: int = 1500, txqueuelen: int = 5000) -> None:
    """Move a TUN device of the emulator into `namespace`, as `name` with `address` (CIDR).
    `txqueuelen` sizes the device's packet ring in front of the emulator: the default 500
    overflows when the emulator thread is briefly descheduled (seen on 2 cores)."""
    ip("link", "set", tun, "netns", namespace)
    ip("-n", namespace, "link", "set", tun, "name", name)
    ip("-n", namespace, "addr", "add", address, "dev", name)
    ip("-n", namespace, "link", "set", name, "mtu", str(mtu), "txqueuelen", str(txqueuelen), "up")


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, wait_s: float = 3.0) -> None:
    """Signal `proc`, wait `wait_s` for it, then kill it."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def remove_namespaces(namespaces: Sequence[str], devices: Sequence[str] = ()) -> None:
    """Kill whatever still runs in each namespace, delete it, then the root-side devices."""
    for ns in namespaces:
        for pid in ip("netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "del", ns, check=False)
    for device in devices:
        ip("link", "del", device, check=False)
