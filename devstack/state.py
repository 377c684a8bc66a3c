"""The state file of `prfaas up` ($PRFAAS_HOME/up.json, mode 0600) and stopping what it names
(`prfaas down`): process groups phase by phase, network namespaces, a shared Redis's keys."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import redis
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from prfaas.devstack.netns import remove_namespaces
from prfaas.devstack.processes import group_alive, pid_alive, start_ticks, stop_group

STATE_FILE = "up.json"
Pid = Annotated[int, Field(gt=1)]  # 0, -1 and 1 would signal our own group, every process, init
SupervisorPid = Annotated[int, Field(ge=1)]  # `prfaas up` may be a container's init (pid 1): signalled alone, no group


class UpError(RuntimeError):
    """The deployment cannot start (or stop); the message says what to do."""


@dataclass
class UpState:
    """Contents of $PRFAAS_HOME/up.json."""

    # read_state: every field of its type (a string where a list belongs was taken letter by letter)
    __pydantic_config__ = ConfigDict(strict=True, extra="forbid")

    api_base: str
    api_key: str
    admin_key: str
    dashboard_url: str
    url: str
    tenant_id: str
    topology: str
    redis_url: str
    key_prefix: str
    registry: str
    log_dir: str
    emulate_wan: bool
    supervisor_pid: SupervisorPid | None = None
    groups: dict[str, Pid] = field(default_factory=dict)  # process name -> process group id
    namespaces: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)  # root-namespace interfaces (the WAN mesh's bridge)
    private_redis: bool = False
    regions: dict[str, str] = field(default_factory=dict)  # region name -> gRPC endpoint
    started: dict[str, int] = field(default_factory=dict)  # pid -> its start time (start_ticks): still ours?
    api_drain_s: Annotated[float, Field(ge=0, le=3600)] = 20.0  # the API's shutdown_timeout_s: `down` waits it

    def record(self, pid: int) -> None:
        ticks = start_ticks(pid)
        if ticks is not None:
            self.started[str(pid)] = ticks

    def ours(self, pid: int) -> bool:
        """Whether `pid` (a process, or a group's leader) is still the one this state recorded: a crashed run's
        file may name a pid the system has since given to another process, which `down` must not signal (a
        group's id is never reused while any of its processes lives, so a leader gone leaves its group ours).
        Without a recorded start time it is not: `up` records one for every process it starts."""
        recorded = self.started.get(str(pid))
        if recorded is None:
            return False
        now = start_ticks(pid)
        return now is None or now == recorded


def state_path(home: Path) -> Path:
    return home / STATE_FILE


_SHAPE = TypeAdapter(UpState)


def read_state(home: Path) -> UpState | None:
    """The state in `home`; None when there is none. UpError names each malformed field: nothing in a file
    that is not whole is acted on."""
    try:
        return _SHAPE.validate_json(state_path(home).read_bytes())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UpError(f"{state_path(home)}: {exc.strerror}") from None
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}" for e in exc.errors()[:3])
        raise UpError(f"{state_path(home)} is not a prfaas up state file ({fields}); remove it by hand") from None


def write_state(home: Path, state: UpState) -> None:
    """Replace up.json with a file created 0600 (it holds the admin key: never readable by others, not even
    until a chmod); `home`, made here when missing, is 0700."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = home / f".{STATE_FILE}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(state), indent=2) + "\n")
        os.replace(tmp, state_path(home))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def stop_state(state: UpState, say: Callable[[str], None]) -> None:
    """Stop what `state` names: the API first (it drains: its streams end whole, or with an error event when its
    `shutdown_timeout_s` is up, while the workers, link emulators and regions their jobs need still run), then
    workers and link emulators, then regions, then Redis; namespaces last."""
    rank = {"api": 0, "redis": 3}
    phases: dict[int, list[str]] = {}
    for name in state.groups:
        phases.setdefault(2 if name.startswith("region-") else rank.get(name, 1), []).append(name)
    for _, names in sorted(phases.items()):  # one phase's groups stop side by side
        for name in (n for n in names if str(state.groups[n]) not in state.started and group_alive(state.groups[n])):
            say(f"skipped {name} (process group {state.groups[name]}): no start time recorded, it may not be ours")
        live = [n for n in names if state.ours(state.groups[n]) and group_alive(state.groups[n])]
        with ThreadPoolExecutor(max(1, len(live))) as pool:
            deadline = {"api": state.api_drain_s + 10.0}  # its drain, then its own end
            timeouts = [deadline.get(n, 15.0 if n.startswith("worker") else 8.0) for n in live]
            list(pool.map(stop_group, [state.groups[n] for n in live], timeouts))
        for name in live:
            say(f"stopped {name}")
    if state.namespaces or state.devices:
        remove_namespaces(state.namespaces, state.devices)
        say(f"removed {len(state.namespaces)} network namespaces")
    if not state.private_redis and state.redis_url:
        with contextlib.suppress(redis.RedisError, ValueError):
            client = redis.Redis.from_url(state.redis_url, socket_timeout=5, socket_connect_timeout=2)
            keys = list(client.scan_iter(f"{state.key_prefix}:*", count=1000))
            for i in range(0, len(keys), 1000):
                client.delete(*keys[i : i + 1000])
            client.close()


def keep_previous(run_dir: Path) -> None:
    """Before a run: the last run's logs and spans stay readable in `up.previous/` beside `run_dir` (`prfaas trace`
    finds its jobs there), one run's worth; its keys, certificates and configs (which hold the ticket key) do not.
    Before, every `up`, one that failed too, deleted them."""
    previous = run_dir.with_name("up.previous")
    if previous.exists():
        shutil.rmtree(previous)
    if not run_dir.exists():
        return
    run_dir.rename(previous)
    shutil.rmtree(previous / "pki", ignore_errors=True)
    for config in previous.glob("*.yaml"):
        config.unlink()


def down(home: Path, say: Callable[[str], None], timeout_s: float = 60.0) -> bool:
    """Stop the deployment `home/up.json` names; False when there is none. A foreground `prfaas up` is given
    `timeout_s`, or its API's drain and the phases after it, whichever is longer."""
    state = read_state(home)
    if state is None:
        return False
    timeout_s = max(timeout_s, state.api_drain_s + 45.0)
    pid = state.supervisor_pid
    if pid and pid != os.getpid() and str(pid) not in state.started and pid_alive(pid):
        say(f"skipped prfaas up (pid {pid}): no start time recorded, it may not be ours")
    if pid and pid != os.getpid() and pid_alive(pid) and state.ours(pid):
        say(f"asking prfaas up (pid {pid}) to stop")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)
        deadline = time.monotonic() + timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    stop_state(state, say)  # whatever the supervisor left (or all of it, when detached)
    with contextlib.suppress(FileNotFoundError):
        state_path(home).unlink()
    return True
