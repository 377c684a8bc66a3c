"""`prfaas down` stops the API first, so that it drains (api/shutdown.py) while the workers, link emulators and
regions its jobs need still run; then workers and link emulators, then regions, then Redis. Before, regions
went first: a stream in flight lost its decode region and its client saw the stream fail before the API was
even told to stop. Real processes, each in a group of its own, that write down when SIGTERM reached them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prfaas.devstack.state import UpState, stop_state

# SIGTERM: write the name down, take `linger` seconds (a drain), exit
CHILD = """
import signal, sys, time
name, out, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
def stop(*_):
    with open(out, "a") as f:
        f.write(f"{name} {time.monotonic():.3f}\\n")
    time.sleep(linger)
    with open(out + ".exited", "a") as f:  # not killed before its end
        f.write(name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""


def test_down_stops_the_api_first_and_waits_for_its_drain_before_regions(tmp_path: Path) -> None:
    out = tmp_path / "stopped.txt"
    state = UpState(api_base="", api_key="", admin_key="", dashboard_url="", url="", tenant_id="", topology="",
                    redis_url="", key_prefix="p", registry="", log_dir=str(tmp_path), emulate_wan=False,
                    api_drain_s=5.0)  # fmt: skip
    procs = []
    for name, linger in [("region-a", 0), ("worker-1", 0), ("api", 1.0), ("linkemu-0", 0), ("redis", 0)]:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, name, str(out), str(linger)], start_new_session=True,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        state.groups[name] = proc.pid
        state.record(proc.pid)
        procs.append(proc)
    said: list[str] = []
    stop_state(state, said.append)
    for proc in procs:
        proc.wait(5)
    exited = (tmp_path / "stopped.txt.exited").read_text().split()
    assert sorted(exited) == ["api", "linkemu-0", "redis", "region-a", "worker-1"]  # none was killed mid-stop
    stopped = [(line.split()[0], float(line.split()[1])) for line in out.read_text().splitlines()]
    names = [name for name, _ in stopped]
    assert names[0] == "api" and set(names[1:3]) == {"worker-1", "linkemu-0"} and names[3:] == ["region-a", "redis"]
    assert stopped[1][1] - stopped[0][1] >= 0.9  # the next phase waited for the API's drain to end
    assert said[0] == "stopped api", said
