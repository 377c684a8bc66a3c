"""The userspace WAN emulator (devstack/linkemu) and how devstack starts it (devstack/netns.py)."""

from __future__ import annotations

import contextlib
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
     ["--arena-mb", "17592186044416"], ["--loss-pct", "101"], ["--rate-mbit", "1e-300"]],
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

    def interrupt() -> None:  # once the emulator runs and we wait for its `ready` (not while it is forked)
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a run in the background ignores it
    try:
        with pytest.raises(KeyboardInterrupt):
            start_linkemu(["sh", "-c", script])
    finally:
        signal.signal(signal.SIGINT, previous)
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


@pytest.mark.skipif(os.geteuid() != 0, reason="TUN devices and namespaces need root")
def test_a_link_and_its_reverse_are_one_emulator_with_each_directions_own_figures(tmp_path: Path) -> None:
    """east -> west 100 Mbit/s and west -> east 10 Mbit/s, 1 % loss: one emulator carries both, the b -> a
    direction with the reverse link's figures (they were the forward link's), and either link names it
    (cutting west -> east found no emulator)."""
    from prfaas.devstack.network import WanMesh
    from prfaas.devstack.topology import topology_from_mapping

    topology = topology_from_mapping({
        "regions": [{"name": "east", "role": "both", "usd_per_gpu_hour": 1},
                    {"name": "west", "role": "both", "usd_per_gpu_hour": 1}],
        "links": [{"src": "east", "dst": "west", "rtt_ms": 40, "rate_mbit": 100},
                  {"src": "west", "dst": "east", "rtt_ms": 40, "rate_mbit": 10, "loss_pct": 1}],
    })  # fmt: skip
    mesh = WanMesh(topology, tmp_path)
    try:
        mesh.setup()
        pid = mesh.link_emulator("east", "west")
        assert pid is not None and mesh.link_emulator("west", "east") == pid and len(mesh.groups) == 1
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        assert argv[argv.index("--rate-mbit") + 1] == "100.0"
        assert argv[argv.index("--rate-mbit-ba") + 1] == "10.0" and argv[argv.index("--loss-pct-ba") + 1] == "1.0"
    finally:
        for group in mesh.groups.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(group, signal.SIGTERM)
        remove_namespaces(mesh.namespaces, mesh.devices)


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")
def test_a_namespace_whose_setup_fails_is_removed_and_the_error_is_an_oserror() -> None:
    name = f"lkt{os.getpid() % 100000}-half"
    with pytest.raises(OSError, match=r"sysctl net\.no\.such\.key=1"):
        add_namespace(name, {"net.no.such.key": "1"})
    assert name not in ip("netns", "list").stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="TUN devices and namespaces need root")
def test_a_cut_shorter_than_the_delay_still_drops_what_was_on_the_wire() -> None:
    """A packet in the 300 ms delay line when a 50 ms cut began is lost, as on a cut fibre, even though the
    link is back when it falls due (it was delivered)."""
    import sys

    from prfaas.devstack.wanlink import wan_link

    send = "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('10.77.0.2', 9))"
    with wan_link(600.0, 0.0, 0.0, name_prefix="lkc") as link:
        before = link.counters()["a->b"]
        link.check_in("a", [sys.executable, "-c", send], timeout=10)
        link.cut()
        time.sleep(0.05)
        link.restore()
        time.sleep(0.6)
        after = link.counters()["a->b"]
    assert after["rx_pkts"] > before["rx_pkts"]
    assert after["tx_pkts"] == before["tx_pkts"] and after["drop_cut"] > before["drop_cut"]


@pytest.mark.skipif(os.geteuid() != 0, reason="TUN devices need root")
def test_a_delay_line_it_cannot_hold_is_refused_at_start() -> None:
    """100 Gbit/s x 1 s one way is 12.5 GB in flight: refused, where a fixed 64 MiB arena dropped packets
    below the configured rate (drop_buf) with an empty queue."""
    done = subprocess.run([str(build_linkemu()), "--tun-a", "lkz0a", "--tun-b", "lkz0b", "--rate-mbit", "100000",
                           "--delay-ms", "1000"], capture_output=True, text=True, timeout=10)  # fmt: skip
    assert done.returncode == 2 and "MiB of delay line" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")
def test_a_mesh_takes_a_control_subnet_no_interface_holds(tmp_path: Path) -> None:
    """The subnet came from the pid alone: a second mesh (or a stale bridge) on it took the same routes."""
    from prfaas.devstack.network import WanMesh
    from prfaas.devstack.topology import topology_from_mapping

    topology = topology_from_mapping({"regions": [{"name": "east", "role": "both", "usd_per_gpu_hour": 1}]})
    mesh = WanMesh(topology, tmp_path)
    taken, squatter = mesh.subnet, f"lks{os.getpid() % 100000}"
    ip("link", "add", squatter, "type", "bridge")
    try:
        ip("addr", "add", f"10.79.{taken}.200/24", "dev", squatter)
        mesh.setup()
        assert mesh.subnet != taken and mesh.registry_host == f"10.79.{mesh.subnet}.1"
    finally:
        remove_namespaces(mesh.namespaces, [*mesh.devices, squatter])


KILLED_MID_SETUP = """
import os, signal, sys
from pathlib import Path
import prfaas.devstack.network as network
network.attach_tun = lambda *_: os.kill(os.getpid(), signal.SIGKILL)  # namespaces, bridge, an emulator made
from prfaas.devstack.deployment import Deployment
from prfaas.devstack.topology import topology_from_mapping
topology = topology_from_mapping({
    "regions": [{"name": "east", "role": "both", "usd_per_gpu_hour": 1},
                {"name": "west", "role": "both", "usd_per_gpu_hour": 1}],
    "links": [{"src": "east", "dst": "west", "rtt_ms": 40, "rate_mbit": 100}],
})
Deployment(topology, "t.yaml", Path(sys.argv[1]), True, print, insecure=True).start()
"""


def _made_by(tag: str) -> tuple[list[str], list[str], list[int]]:
    """The namespaces, root-namespace devices and processes (by their argv) whose names carry `tag`."""
    namespaces = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.startswith(f"{tag}-")]
    devices = [line.split(": ")[1].split("@")[0] for line in ip("-o", "link", "show").stdout.splitlines()]
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _argv_has(p, tag)]
    return namespaces, [d for d in devices if d.startswith(tag)], pids


def _argv_has(proc: Path, tag: str) -> bool:
    try:
        return tag in (proc / "cmdline").read_text()
    except OSError:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="TUN devices and namespaces need root")
def test_a_run_killed_while_it_builds_the_wan_leaves_down_all_it_made(tmp_path: Path) -> None:
    """SIGKILLed mid-setup (no `finally` runs), `prfaas up` left namespaces, the bridge, veths and a running
    emulator that up.json did not name: they were written only once setup returned. Each is named as it is
    made, so `down` removes all of it."""
    import sys

    from prfaas.devstack.state import down, read_state, stop_state

    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_SETUP, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    tag = f"pu{proc.pid}"
    try:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, output
        namespaces, devices, emulators = _made_by(tag)
        state = read_state(tmp_path)
        assert state is not None and namespaces and emulators
        assert set(namespaces) <= set(state.namespaces)
        assert {d for d in devices if f"{tag}t" not in d} <= set(state.devices)  # the TUNs go with the emulator
        assert emulators == [state.groups["linkemu-1"]]
        assert down(tmp_path, lambda _: None, timeout_s=5)
        deadline = time.monotonic() + 5
        while _made_by(tag) != ([], [], []) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _made_by(tag) == ([], [], [])
    finally:
        leftover = read_state(tmp_path)
        if leftover is not None:
            stop_state(leftover, lambda _: None)  # the private Redis
        namespaces, devices, emulators = _made_by(tag)
        for pid in emulators:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        remove_namespaces(namespaces, devices)


@pytest.mark.skipif(os.geteuid() != 0, reason="TUN devices and namespaces need root")
def test_a_link_given_its_rate_back_drains_its_slow_queue_at_that_rate() -> None:
    """10 Mbit/s of UDP into a 20 Mbit/s link slowed to 2 Mbit/s for a second: once its rate is back, the
    queue built meanwhile drains in ~0.1 s and new packets pass. The queue kept its slow schedule and its
    backlog, read at the new rate, looked 10x fuller: nearly every packet was dropped for a second."""
    import sys

    from prfaas.devstack.wanlink import wan_link

    send = ("import socket, time\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "end = time.monotonic() + 3.2\n"
            "while time.monotonic() < end:\n"
            "    for _ in range(25):\n"
            "        s.sendto(bytes(1000), ('10.77.0.2', 9))\n"
            "    time.sleep(0.02)\n")  # fmt: skip
    with wan_link(10.0, 20.0, 0.0, queue_bytes=250_000, name_prefix="lks") as link:
        sender = link.run_in("a", [sys.executable, "-c", send])
        try:
            time.sleep(1.0)
            link.slow()
            time.sleep(1.0)
            link.unslow()
            time.sleep(0.4)  # the slow queue's 250 KB drain in 0.1 s at 20 Mbit/s
            before = link.counters()["a->b"]
            time.sleep(0.6)
            after = link.counters()["a->b"]
        finally:
            sender.kill()
            sender.wait()
    arrived = after["rx_pkts"] - before["rx_pkts"]
    dropped = after["drop_queue"] - before["drop_queue"]
    assert arrived > 300 and dropped < arrived * 0.1, (arrived, dropped)
