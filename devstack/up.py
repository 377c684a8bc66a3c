"""`prfaas up`'s supervisor: start the deployment (devstack/deployment.py), keep it up in the foreground until a
signal (SIGINT, SIGTERM, SIGHUP: Ctrl-C, `prfaas down`, a closed terminal), then stop all of it. A signal
while it starts stops what has started at once, regions still loading their model included, and is an
`Interrupted` error (the deployment never came up); a second signal does not cut the stop short."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path

from prfaas.devstack.deployment import Deployment
from prfaas.devstack.preflight import preflight
from prfaas.devstack.processes import group_alive, pid_alive
from prfaas.devstack.state import UpError, UpState, read_state, state_path, stop_state, write_state
from prfaas.devstack.supervise import Supervisor
from prfaas.devstack.topology import Topology

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(UpError):
    """A signal came before the deployment was up; what had started is stopped."""


def claim_home(home: Path) -> None:
    """`UpError` when the deployment of `home/up.json` is still up; else remove a crashed run's leftovers
    (namespaces, keys, the file) and make `home` if missing, mode 0700: up.json in it holds the admin key, and
    `deployments/` the tenants and their key digests. `prfaas up` calls it before it builds a model, which
    would otherwise make the home (umask-wide) and take a minute before saying that a deployment is up."""
    old = read_state(home)
    if old is not None:
        supervised = old.supervisor_pid and pid_alive(old.supervisor_pid) and old.ours(old.supervisor_pid)
        if any(old.ours(g) and group_alive(g) for g in old.groups.values()) or supervised:
            raise UpError(f"a deployment is already up ({old.url or 'starting'}); run `prfaas down` first")
        stop_state(old, lambda _: None)  # a crashed run's leftovers (namespaces, keys)
        state_path(home).unlink()
    home.mkdir(mode=0o700, parents=True, exist_ok=True)


def run_up(
    topology: Topology,
    topology_path: str,
    home: Path,
    emulate_wan: bool,
    detach: bool,
    say: Callable[[str], None],
    on_ready: Callable[[UpState], None],
    *,
    hosts: bool = False,
    insecure: bool = False,
) -> UpState | None:
    """Start the deployment; unless `detach`, keep it up until a stop signal, then stop it. Returns the state
    (None once a foreground run has stopped). Raises `UpError` (`Interrupted` for a signal before it was up),
    and before any process starts when a deployment is already up (`claim_home`) or the topology's model is
    unknown or not prepared (`preflight`)."""
    claim_home(home)
    preflight(topology)

    def tell(message: str) -> None:  # a closed terminal (SIGHUP) makes every print fail: the stop goes on
        with contextlib.suppress(OSError):
            say(message)

    deployment = Deployment(topology, topology_path, home, emulate_wan, tell, hosts=hosts, insecure=insecure)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    # Installed, not inherited: a shell starts background jobs with SIGINT ignored, and Python then keeps
    # ignoring it, so Ctrl-C (or a supervisor's SIGINT) would not stop the run.
    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    keep = up = False
    try:
        state = deployment.start()
        up = True
        if detach:
            state.supervisor_pid = None
            write_state(home, state)
            keep = True
            on_ready(state)
            return state
        on_ready(state)
        supervisor = Supervisor(deployment, topology.restarts, tell)  # a crashed process is started again
        while True:
            supervisor.step()
            time.sleep(0.5)
    except KeyboardInterrupt:
        tell("stopping")
        if not up:
            raise Interrupted("interrupted before the deployment was up; what had started is stopped") from None
        return None
    finally:
        if not keep:
            for sig in STOP_SIGNALS:  # a second signal must not cut the cleanup short
                signal.signal(sig, signal.SIG_IGN)
            deployment.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
