"""Drive a peer-library transfer pair (bench/peers/peer_bench.py roles) from any Python.

Standard library only: imported by bench/transport_loopback.py and bench/peers/wan.py
under the main venv, and by peer_bench.py --selftest under .venv-peers.

    with PeerPair("mooncake", 256 << 20, python=peers_python()) as pair:
        result = pair.transfer(256 << 20)   # {"ok", "seconds", "gb_per_s", "cpu_s", ...}

Every wait has a deadline. A role that does not answer in time (a hung library call) is
killed with its process group, and the pair raises PeerError carrying the tail of the
role's stderr; a pair is not used again after that.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PEER_BENCH = HERE / "peer_bench.py"
SYSTEMS = ("mooncake", "nixl")
CONTROL_WAIT_S = 15.0  # a role's answer to a command that moves no data (zeroing 256 MiB included)

# spawn(side, argv, **popen_kwargs) -> Popen; side is "recv" or "send"
Spawn = Callable[..., "subprocess.Popen[str]"]


class PeerError(RuntimeError):
    pass


def peers_python() -> Path | None:
    """The .venv-peers interpreter (or $PRFAAS_PEERS_PYTHON), None when it is not set up."""
    env = os.environ.get("PRFAAS_PEERS_PYTHON")
    path = Path(env) if env else ROOT / ".venv-peers" / "bin" / "python"
    return path if path.exists() else None


def _default_spawn(side: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, **kwargs)


class Role:
    """One role process: JSON commands on stdin, JSON replies read by a thread into a queue."""

    def __init__(self, name: str, popen: subprocess.Popen[str], stderr_path: Path) -> None:
        self.name, self.p, self.stderr_path = name, popen, stderr_path
        self.replies: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"peer-{name}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        with contextlib.suppress(ValueError, OSError):
            for line in self.p.stdout:
                self.replies.put(line)
        self.replies.put(None)

    def stderr_tail(self, n: int = 1500) -> str:
        with contextlib.suppress(OSError):
            return self.stderr_path.read_text(errors="replace")[-n:]
        return ""

    def read(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise PeerError(
                    f"{self.name}: no answer within {timeout_s:.0f} s; killed. stderr: {self.stderr_tail()}"
                ) from None
            if line is None:
                rc = self.p.wait()
                raise PeerError(f"{self.name}: exited with {rc}. stderr: {self.stderr_tail()}")
            with contextlib.suppress(json.JSONDecodeError):
                reply: dict[str, Any] = json.loads(line)
                return reply

    def ask(self, wait_s: float, **cmd: Any) -> dict[str, Any]:
        """Send cmd, return the reply; wait_s bounds the wait (then the role is killed)."""
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(json.dumps(cmd) + "\n")
            self.p.stdin.flush()
        except OSError as exc:
            raise PeerError(f"{self.name}: {exc}. stderr: {self.stderr_tail()}") from exc
        return self.read(wait_s)

    def kill(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.p.pid, signal.SIGKILL)  # its own session: the role and its children
            with contextlib.suppress(ProcessLookupError):
                self.p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(5)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Ask it to quit; kill it past timeout_s. Returns the exit code."""
        if self.p.poll() is None:
            with contextlib.suppress(PeerError):
                self.ask(timeout_s, op="quit")
            with contextlib.suppress(OSError):
                assert self.p.stdin is not None
                self.p.stdin.close()
            try:
                self.p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.p.poll()


class PeerPair:
    """A receiver and a sender of one peer library, kept for many transfers.

    recv_host/send_host: each end's address (the receiver's is what the sender connects to).
    device: UCX_NET_DEVICES for NIXL ("lo" on loopback, the link's device in a namespace).
    spawn: how to start a role; default a plain subprocess, bench/peers/wan.py puts them in
    the namespaces. timeout_s bounds start-up and the handshake; each transfer has its own.
    """

    def __init__(
        self,
        system: str,
        size: int,
        *,
        python: str | Path,
        recv_host: str = "127.0.0.1",
        send_host: str = "127.0.0.1",
        device: str | None = "lo",
        data: str | Path | None = None,
        spawn: Spawn | None = None,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if system not in SYSTEMS:
            raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
        self.system, self.size, self.python = system, size, str(python)
        self.recv_host, self.send_host, self.device, self.data = recv_host, send_host, device, data
        self.spawn = spawn or _default_spawn
        self.timeout_s = timeout_s
        self.env = {**os.environ, "UCX_TLS": "tcp", "UCX_MODULES": "^ib", **(env or {})}
        if device:
            self.env["UCX_NET_DEVICES"] = device
        self.setup: dict[str, float] = {}
        self.checksum = ""
        self._tmp = tempfile.TemporaryDirectory(prefix=f"peer-{system}-")
        self.rx: Role | None = None
        self.tx: Role | None = None
        self._digests: dict[int, str] = {}

    def _start(self, side: str, host: str) -> Role:
        argv = [
            self.python,
            str(PEER_BENCH),
            "--role",
            f"{self.system}-{side}",
            "--host",
            host,
            "--size",
            str(self.size),
        ]
        if side == "send" and self.data:
            argv += ["--data", str(self.data)]
        err = Path(self._tmp.name) / f"{side}.stderr"
        with err.open("w") as err_f:
            popen = self.spawn(side, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_f, text=True,
                               env=self.env, start_new_session=True)  # fmt: skip
        return Role(f"{self.system}-{side}", popen, err)

    def start(self) -> PeerPair:
        t0 = time.perf_counter()
        self.rx = self._start("recv", self.recv_host)
        ready_rx = self.rx.read(self.timeout_s)
        self.tx = self._start("send", self.send_host)
        ready_tx = self.tx.read(self.timeout_s)
        self._digests[self.size] = ready_tx["digest"]
        self.checksum = ready_tx["checksum"]
        self.rx.ask(self.timeout_s, op="hello", peer={**ready_tx["info"], "host": self.send_host})
        peer = {**ready_rx["info"], "host": self.recv_host}
        t1 = time.perf_counter()
        conn = self.tx.ask(self.timeout_s, op="connect", peer=peer)
        if not conn.get("ok"):
            raise PeerError(f"{self.system} connect failed: {conn.get('error')}. stderr: {self.tx.stderr_tail()}")
        self.setup = {
            "recv_init_s": ready_rx["setup_s"],
            "send_init_s": ready_tx["setup_s"],
            "payload_load_s": ready_tx.get("load_s", 0.0),
            "connect_s": conn["connect_s"],  # handshake + a 4 KiB warm-up write
            "connect_wall_s": time.perf_counter() - t1,
            "total_wall_s": time.perf_counter() - t0,
        }
        return self

    def digest(self, nbytes: int) -> str:
        if nbytes not in self._digests:
            assert self.tx is not None
            self._digests[nbytes] = self.tx.ask(self.timeout_s, op="digest", nbytes=nbytes)["digest"]
        return self._digests[nbytes]

    def transfer(self, nbytes: int | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        """Move nbytes (default: the whole buffer) sender -> receiver; verify; time it.

        Raises PeerError when a role dies or overruns (then both are killed); a transfer that
        the library reports failed, or whose bytes do not match, returns ok=False."""
        assert self.rx is not None and self.tx is not None, "start() first"
        n = self.size if nbytes is None else nbytes
        want = self.digest(n)
        tag = f"x-{uuid.uuid4().hex[:12]}"
        try:
            cpu_rx0 = self.rx.ask(CONTROL_WAIT_S, op="arm", tag=tag, timeout_s=timeout_s + 5)["cpu_s"]
            sent = self.tx.ask(timeout_s + 10, op="send", nbytes=n, tag=tag, timeout_s=timeout_s)
            checked = self.rx.ask(timeout_s + 10, op="verify", nbytes=n, digest=want, tag=tag,
                                  timeout_s=10.0 if sent.get("ok") else 0.5)  # fmt: skip
        except PeerError:
            self.kill()
            raise
        send_s = float(sent.get("seconds") or 0.0)
        # delivered = the later of the sender's completion and the receiver seeing the data (NIXL's
        # notification, polled every 0.2 ms); Mooncake's sync write completes at the target already
        seconds = max(send_s, checked["t_seen"] - sent["t0"]) if checked.get("t_seen") and "t0" in sent else send_s
        ok = bool(sent.get("ok") and checked.get("ok"))
        error = sent.get("error") or checked.get("error") or ("" if ok else "received bytes do not match")
        return {
            "system": self.system,
            "ok": ok,
            "error": error,
            "bytes": n,
            "seconds": seconds,
            "send_seconds": send_s,
            "gb_per_s": n / seconds / 1e9 if ok and seconds > 0 else 0.0,
            "cpu_s_send": sent.get("cpu_s", 0.0),
            "cpu_s_recv": checked.get("cpu_s", cpu_rx0) - cpu_rx0,
            "tcp_conns": sent.get("tcp_conns", 0),
            "checksum": self.checksum,
        }

    def kill(self) -> None:
        for role in (self.tx, self.rx):
            if role is not None:
                role.kill()

    def close(self) -> dict[str, int | None]:
        """Quit both roles (killed if they do not); returns their exit codes."""
        codes = {}
        for role in (self.tx, self.rx):
            if role is not None:
                codes[role.name] = role.stop()
        self._tmp.cleanup()
        return codes

    def __enter__(self) -> PeerPair:
        try:
            return self.start()
        except BaseException:
            self.kill()
            self._tmp.cleanup()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
