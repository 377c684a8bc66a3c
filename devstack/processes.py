"""Starting and stopping a deployment's processes: the API (uvicorn), Celery workers and
`prfaas region` processes, each by its command line; process-group bookkeeping; small waits
(`wait_until`, `http_ok`, `free_port`). Shared by `prfaas up` (deployment.py), the stack the
tests and benches use (stack.py) and the vLLM tests."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.02) -> float:
    """Seconds until `predicate()` held; raises AssertionError after `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def api_argv(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "--factory", "prfaas.control_plane.app:app_from_env",
            "--host", host, "--port", str(port), "--log-level", "warning"]  # fmt: skip


def beat_argv(schedule: Path) -> list[str]:
    """Celery beat: the metering schedule (price refresh, the ledger's reconciliation sweep)."""
    return [sys.executable, "-m", "celery", "-A", "prfaas.control_plane.worker", "beat", "--schedule", str(schedule),
            "--loglevel", "WARNING"]  # fmt: skip


def worker_argv(name: str, concurrency: int) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "prfaas.control_plane.worker", "worker", "--pool", "threads",
            "-c", str(concurrency), "-n", f"{name}@%h", "--without-gossip", "--without-mingle",
            "--loglevel", "WARNING"]  # fmt: skip


# A region on this host for a test or a bench: every port picked free, metrics on, raw KV.
LOOPBACK_REGION: dict[str, Any] = {
    "listen": {"grpc": "127.0.0.1:0", "kv": "127.0.0.1:0", "metrics": "127.0.0.1:0"}, "codec": "raw",
    "ticket_key_id": "k1", "heartbeat_interval_s": 0.5,
}  # fmt: skip


def write_region_config(path: Path, config: dict[str, Any]) -> Path:
    """`config` as the YAML file `prfaas region --config` reads; mode 0600 from the start (it
    holds the ticket key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        yaml.safe_dump(config, out)
    return path


def region_argv(config: Path, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "prfaas.cli.main", "region", "--config", str(config),
            "--log-level", "WARNING"]  # fmt: skip


@dataclass
class RegionProcess:
    proc: subprocess.Popen[str]
    grpc: str
    kv: str
    metrics: str
    lines: list[str] = field(default_factory=list)
    name: str = ""  # the region's, as its ready line says
    instance: str = ""  # the instance's, as its ready line says
    device: str = ""  # what its engine runs on, `cpu/float32` (engine/device.py)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def failure_cause(lines: Sequence[str], limit: int = 300) -> str:
    """The line of a process's output that says why it stopped: the last traceback's exception
    line (`ModelNotPrepared: model ...`), else the last `error:` line, else the last line;
    "no output" for none. At most `limit` characters."""
    text = [line.rstrip() for line in lines if line.strip()]
    # a logger's prefix may come first (uvicorn: "ERROR:    Traceback (most recent call last):")
    starts = [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line]
    cause = ""
    if starts:  # frames are indented; the first line at the margin after them names the exception
        cause = next((line for line in text[starts[-1] + 1 :] if not line[:1].isspace()), "")
    if not cause:
        found = next((i for i in reversed(range(len(text))) if "error:" in text[i].lower()), None)
        if found is None:
            cause = text[-1] if text else "no output"
        else:
            cause = text[found]
            if cause.endswith(":"):  # the details follow, indented (a config's field errors)
                details = itertools.takewhile(lambda line: line[:1].isspace(), text[found + 1 :])
                cause = " ".join([cause, *(line.strip() for line in details)])
    cause = cause.strip()
    return cause if len(cause) <= limit else cause[: limit - 3] + "..."


def log_cause(log: Path) -> str:
    """`failure_cause` of a log file (its last 64 KiB)."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (64 << 10)))
            return failure_cause(f.read().decode(errors="replace").splitlines())
    except OSError as exc:
        return f"no log ({exc.strerror})"


def _ready_fields(line: str) -> dict[str, str]:
    return dict(part.partition("=")[::2] for part in line.split()[1:])


def spawn_region(
    config: Path,
    timeout_s: float = 120,
    env: Mapping[str, str] | None = None,
    *,
    argv_prefix: Sequence[str] = (),
    log: Path | None = None,
    new_session: bool = False,
    python: str | None = None,
    on_spawn: Callable[[subprocess.Popen[Any]], None] | None = None,
) -> RegionProcess:
    """Start `prfaas region --config` and wait for its `ready grpc=... kv=...` line.

    `argv_prefix` runs it under another command (`ip netns exec NS`); `log` sends its output to
    a file instead of a pipe (a process that outlives us must not write into a closed pipe);
    `new_session` gives it a process group of its own (stopped as a group, deaf to our Ctrl-C);
    `python` runs it with another interpreter than ours (the vLLM tests run in .venv-vllm); `on_spawn` is
    given the process as soon as it is started, before it is ready (a supervisor records it, to stop it).
    """
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    argv = [*argv_prefix, *region_argv(config, python)]
    full_env |= dict(env or {})
    lines: list[str] = []
    ready: dict[str, str] = {}
    if log is None:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                                start_new_session=new_session)  # fmt: skip

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip())
                if line.startswith("ready "):
                    ready.update(_ready_fields(line))

        threading.Thread(target=read, daemon=True).start()
    else:
        with log.open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=full_env,
                                    start_new_session=new_session)  # fmt: skip
    if on_spawn is not None:
        on_spawn(proc)
    deadline = time.monotonic() + timeout_s
    while not ready and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        if log is not None:
            lines[:] = log.read_text(errors="replace").splitlines()
            ready.update(next((_ready_fields(x) for x in lines if x.startswith("ready ")), {}))
    if not ready:
        status = proc.poll()
        proc.kill()
        proc.wait(5)
        how = f"exited with status {status}" if status is not None else f"not ready after {timeout_s:.0f} s"
        where = f" (log {log})" if log is not None else ":\n" + "\n".join(lines[-30:])
        raise RuntimeError(f"region {config.stem} {how}: {failure_cause(lines)}{where}")
    return RegionProcess(proc, ready["grpc"], ready["kv"], ready["metrics"], lines, ready.get("region", ""),
                         ready.get("instance", ""), ready.get("device", ""))  # fmt: skip


def _exists(probe: Callable[[int, int], None], target: int) -> bool:
    """Signal 0 to a process or group: False only if there is none (another user's counts)."""
    try:
        probe(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_alive(pid: int) -> bool:
    if not _exists(os.kill, pid):
        return False
    with contextlib.suppress(OSError):  # a zombie (exited, not yet reaped) counts as gone
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22); None when there is none."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def group_alive(pgid: int) -> bool:
    return _exists(os.killpg, pgid) and any(pid_alive(pid) for pid in group_members(pgid))


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    members.append(int(entry.name))
    return members


def stop_group(pgid: int, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Signal a process group, wait up to `timeout_s` for it to go, then SIGKILL what is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(-pgid, os.WNOHANG)  # reap our own children so they do not linger as zombies
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        while os.waitpid(-pgid, os.WNOHANG)[0] > 0:
            pass
