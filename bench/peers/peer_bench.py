"""One end of a peer-library KV transfer: Mooncake's transfer engine (TCP) or NIXL (UCX over TCP).

Runs under .venv-peers (bash bench/peers/setup.sh): standard library, numpy and the peer
libraries only, never prfaas. bench/peers/driver.py starts one receiver and one sender as
subprocesses (on loopback, or inside the WAN namespaces) and talks to each over JSON lines:
commands on stdin, replies on the process's original stdout. The libraries' own prints go
to stderr (NIXL logs to stdout), so the protocol stream stays clean.

    receiver                                  sender
    -> {"ready", "setup_s", "info"}           -> {"ready", "setup_s", "digest", "checksum"}
    {"op": "arm"}     zero the buffer         {"op": "connect", "peer": info}  handshake + 4 KiB warm-up
    {"op": "verify", "digest", "nbytes",      {"op": "send", "nbytes", "tag", "timeout_s"}
     "tag", "timeout_s"}                          -> {"ok", "seconds", "cpu_s", "tcp_conns"}
        -> {"ok", "digest", "cpu_s"}
    {"op": "quit"}                            {"op": "quit"}

A send moves the first nbytes of the sender's buffer into the receiver's buffer with one
one-sided WRITE (Mooncake `transfer_sync_write`, NIXL `initialize_xfer("WRITE")` +
`transfer` + polling `check_xfer_state`); `seconds` covers exactly that, nothing of the
setup. The receiver then checks the bytes it holds against the sender's digest (xxh3-64
when xxhash is installed, else blake2b).

Standalone check on loopback (no prfaas needed):

    .venv-peers/bin/python bench/peers/peer_bench.py --selftest --system mooncake nixl --size-mb 16
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

WARMUP_BYTES = 4096
SYSTEMS = ("mooncake", "nixl")


# ------------------------------------------------------------------ helpers


def checksum_name() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "blake2b"
    return "xxh3_64"


def digest(buf: np.ndarray, nbytes: int) -> str:
    view = buf[:nbytes].data
    try:
        import xxhash
    except ImportError:
        return hashlib.blake2b(view, digest_size=16).hexdigest()
    return str(xxhash.xxh3_64_hexdigest(view))


def load_payload(size: int, data: str | None, seed: int = 1) -> np.ndarray:
    """size bytes: the arrays of an .npy/.npz file back to back (repeated to size), else random."""
    buf = np.empty(size, np.uint8)
    if data:
        path = Path(data)
        if path.suffix == ".npz":
            with np.load(path) as z:
                parts = [np.ascontiguousarray(z[k]).view(np.uint8).reshape(-1) for k in z.files]
        else:
            parts = [np.ascontiguousarray(np.load(path)).view(np.uint8).reshape(-1)]
        src = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        if not len(src):
            raise ValueError(f"{data} holds no bytes")
        for off in range(0, size, len(src)):
            n = min(len(src), size - off)
            buf[off : off + n] = src[:n]
    else:
        buf[:] = np.frombuffer(np.random.default_rng(seed).bytes(size), np.uint8)
    return buf


def tcp_conns_to(peer_ip: str) -> int:
    """Established TCP connections of this process whose remote address is peer_ip (IPv4)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    try:
        want = f"{struct.unpack('<I', socket.inet_aton(peer_ip))[0]:08X}"
        lines = Path("/proc/self/net/tcp").read_text().splitlines()[1:]
    except (OSError, ValueError):
        return 0
    n = 0
    for line in lines:
        f = line.split()
        if len(f) > 9 and f[3] == "01" and f[2].split(":")[0] == want and f[9] in inodes:
            n += 1
    return n


class Proto:
    """The JSON-lines reply stream: the process's original stdout, with fd 1 pointed at stderr."""

    def __init__(self) -> None:
        self.out: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def reply(self, **value: Any) -> None:
        self.out.write(json.dumps(value) + "\n")
        self.out.flush()

    def commands(self) -> Any:
        for line in sys.stdin:
            if line.strip():
                yield json.loads(line)


# ------------------------------------------------------------------ Mooncake transfer engine (TCP)


class Mooncake:
    def __init__(self, host: str, size: int, payload: np.ndarray | None) -> None:
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found,unused-ignore]

        self.host = host
        self.engine = TransferEngine()
        ret = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if ret != 0:
            raise RuntimeError(f"TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) returned {ret}")
        self.buf = payload if payload is not None else np.zeros(size, np.uint8)
        ret = self.engine.register_memory(self.buf.ctypes.data, size)
        if ret != 0:
            raise RuntimeError(f"register_memory returned {ret}")
        self.peer: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        return {"host": self.host, "rpc_port": self.engine.get_rpc_port(), "ptr": self.buf.ctypes.data}

    def connect(self, peer: dict[str, Any]) -> None:
        self.peer = peer
        self.write(WARMUP_BYTES, "warmup", 60.0)  # opens the segment (P2P handshake) and the data connection

    def write(self, nbytes: int, tag: str, timeout_s: float) -> None:
        # transfer_sync_write blocks without a deadline of its own; the driver kills us past ours
        ret = self.engine.transfer_sync_write(
            f"{self.peer['host']}:{self.peer['rpc_port']}", self.buf.ctypes.data, self.peer["ptr"], nbytes
        )
        if ret != 0:
            raise RuntimeError(f"transfer_sync_write returned {ret}")

    def watch(self, tag: str, timeout_s: float) -> None:
        pass

    def wait_delivered(self, tag: str, timeout_s: float) -> float | None:
        return None  # no receiver-side signal: a sync write returns after the target stored the bytes

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.unregister_memory(self.buf.ctypes.data)


# ------------------------------------------------------------------ NIXL (UCX backend, TCP transport)


class Nixl:
    def __init__(self, name: str, size: int, payload: np.ndarray | None) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found,unused-ignore]

        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.buf = payload if payload is not None else np.zeros(size, np.uint8)
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, size, 0, "")], "DRAM")
        self.remote = ""
        self.peer: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "meta": base64.b64encode(self.agent.get_agent_metadata()).decode(),  # how the peer reaches this agent
            "ptr": self.buf.ctypes.data,
        }

    def connect(self, peer: dict[str, Any]) -> None:
        self.peer = peer
        self.remote = self.agent.add_remote_agent(base64.b64decode(peer["meta"]))
        if isinstance(self.remote, bytes):
            self.remote = self.remote.decode()
        self.agent.make_connection(self.remote)
        self.write(WARMUP_BYTES, "warmup", 60.0)

    def write(self, nbytes: int, tag: str, timeout_s: float) -> None:
        local = self.agent.get_xfer_descs([(self.buf.ctypes.data, nbytes, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(self.peer["ptr"], nbytes, 0)], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.remote, tag.encode())
        deadline = time.monotonic() + timeout_s
        state = self.agent.transfer(handle)
        spins = 0
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TimeoutError(f"NIXL WRITE of {nbytes} bytes still in progress after {timeout_s} s")
            spins += 1
            if spins > 1000:  # the UCX progress thread moves the data; don't take a core from it
                time.sleep(0.0002)
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL WRITE ended in state {state}")
        handle.release()

    def watch(self, tag: str, timeout_s: float) -> None:
        """Note when the sender's notification `tag` arrives (it follows the data), from a thread,
        so the receiver-side delivery time is known, not only the sender's completion."""
        self.seen: dict[str, Any] = {}
        self.watcher = threading.Thread(target=self._watch, args=(tag, timeout_s), daemon=True)
        self.watcher.start()

    def _watch(self, tag: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        sender = self.peer.get("name", "")
        try:
            while not self.agent.check_remote_xfer_done(sender, tag.encode()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no NIXL notification {tag!r} from {sender!r} within {timeout_s} s")
                time.sleep(0.0002)
            self.seen["t"] = time.monotonic()
        except Exception as exc:
            self.seen["error"] = f"{type(exc).__name__}: {exc}"

    def wait_delivered(self, tag: str, timeout_s: float) -> float | None:
        self.watcher.join(timeout_s)
        if self.watcher.is_alive():
            raise TimeoutError(f"no NIXL notification {tag!r} within {timeout_s} s")
        if "error" in self.seen:
            raise RuntimeError(self.seen["error"])
        return float(self.seen["t"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self.reg)


# ------------------------------------------------------------------ roles


def make_engine(system: str, side: str, host: str, size: int, payload: np.ndarray | None) -> Mooncake | Nixl:
    if system == "mooncake":
        return Mooncake(host, size, payload)
    return Nixl(f"prfaas-bench-{side}-{os.getpid()}", size, payload)


def role_recv(system: str, host: str, size: int) -> None:
    proto = Proto()
    t0 = time.perf_counter()
    eng = make_engine(system, "recv", host, size, None)
    proto.reply(ready=True, system=system, setup_s=time.perf_counter() - t0, info=eng.info())
    for cmd in proto.commands():
        op = cmd["op"]
        if op == "hello":  # the sender's identity (NIXL notifications are keyed by agent name)
            eng.peer = cmd["peer"]
            proto.reply(ok=True)
        elif op == "arm":
            eng.buf[:] = 0
            eng.watch(cmd["tag"], cmd.get("timeout_s", 30.0))
            proto.reply(ok=True, cpu_s=time.process_time())
        elif op == "verify":
            try:
                t_seen = eng.wait_delivered(cmd["tag"], cmd.get("timeout_s", 30.0))
            except Exception as exc:
                proto.reply(ok=False, error=f"{type(exc).__name__}: {exc}", cpu_s=time.process_time())
                continue
            cpu = time.process_time()
            got = digest(eng.buf, cmd["nbytes"])
            proto.reply(ok=got == cmd["digest"], digest=got, cpu_s=cpu, t_seen=t_seen)
        elif op == "quit":
            eng.close()
            proto.reply(bye=True)
            break
    proto.out.close()


def role_send(system: str, host: str, size: int, data: str | None) -> None:
    proto = Proto()
    t0 = time.perf_counter()
    payload = load_payload(size, data)
    t_load = time.perf_counter() - t0
    full = digest(payload, size)
    t0 = time.perf_counter()
    eng = make_engine(system, "send", host, size, payload)
    proto.reply(ready=True, system=system, setup_s=time.perf_counter() - t0, load_s=t_load, digest=full,
                checksum=checksum_name(), info=eng.info())  # fmt: skip
    digests = {size: full}
    for cmd in proto.commands():
        op = cmd["op"]
        if op == "connect":
            t0 = time.perf_counter()
            try:
                eng.connect(cmd["peer"])
            except Exception as exc:
                proto.reply(ok=False, error=f"{type(exc).__name__}: {exc}")
                continue
            proto.reply(ok=True, connect_s=time.perf_counter() - t0)
        elif op == "digest":
            n = cmd["nbytes"]
            digests.setdefault(n, digest(payload, n))
            proto.reply(digest=digests[n])
        elif op == "send":
            n = cmd["nbytes"]
            cpu0, t0 = time.process_time(), time.monotonic()
            try:
                eng.write(n, cmd["tag"], cmd.get("timeout_s", 60.0))
            except Exception as exc:
                proto.reply(ok=False, error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - t0)
                continue
            seconds = time.monotonic() - t0
            # CLOCK_MONOTONIC is one clock for all processes and namespaces: t0 lines up with t_seen
            proto.reply(ok=True, seconds=seconds, t0=t0, bytes=n, cpu_s=time.process_time() - cpu0,
                        tcp_conns=tcp_conns_to(eng.peer.get("host") or cmd.get("peer_ip", "127.0.0.1")))  # fmt: skip
        elif op == "quit":
            eng.close()
            proto.reply(bye=True)
            break
    proto.out.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=[f"{s}-{r}" for s in SYSTEMS for r in ("recv", "send")])
    p.add_argument("--host", default="127.0.0.1", help="this end's address (Mooncake binds its RPC port there)")
    p.add_argument("--size", type=int, help="buffer bytes (both ends)")
    p.add_argument("--data", help=".npy/.npz whose bytes fill the sender's buffer (default: random)")
    p.add_argument("--selftest", action="store_true", help="run a loopback pair per system through driver.py")
    p.add_argument("--system", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--size-mb", type=float, default=16.0)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    # UCX over TCP only; without UCX_MODULES=^ib the process segfaults at exit on this machine
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_MODULES", "^ib")
    if a.selftest:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from driver import PeerPair  # type: ignore[import-not-found,unused-ignore]

        size = int(a.size_mb * 2**20)
        for system in a.system:
            with PeerPair(system, size, python=sys.executable, data=a.data) as pair:
                print(f"{system}: setup {pair.setup}", flush=True)
                for r in range(a.rounds):
                    res = pair.transfer(size)
                    print(f"{system} round {r}: {res}", flush=True)
        return 0
    if not a.role or not a.size:
        p.error("--role and --size are required")
    system, side = a.role.split("-")
    if side == "recv":
        role_recv(system, a.host, a.size)
    else:
        role_send(system, a.host, a.size, a.data)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: the libraries' static destructors are not ours to debug
