"""Adapters to the one-sided-write engines of the in-region fast path: Mooncake's transfer
engine and NIXL (UCX). Both are imported only here, only when an engine is built, with an
error naming the package when they are missing (extras `mooncake`, `nixl`).

The adapter is the piece a cross-host version of the shared-memory transport needs
(docs/transports.md): the receiver registers its arena with an engine and publishes
`info()` in HELLO_OK, a sender `connect`s to it, and instead of copying each chunk into a
mapped arena (transport/shm_receiver.py) it `write`s the chunk to `remote base + placement offset`.
On this CPU-only machine both engines run over TCP (Mooncake's "tcp" protocol, UCX with
UCX_TLS=tcp); with RDMA NICs they take `protocol="rdma"` / UCX's verbs transports and
move the bytes without the remote CPU. This module imports nothing else of prfaas but
errors.py, so it also runs in the peers' virtual environment (bench/peers/setup.sh).
"""

from __future__ import annotations

import base64
import contextlib
import os
import time
from typing import Any, Protocol

from prfaas.transport.errors import TransferTimeout, TransportError

PACKAGES = {"mooncake": "mooncake-transfer-engine (or mooncake-transfer-engine-non-cuda)", "nixl": "nixl (nixl-cu12)"}


class RemoteWriter(Protocol):
    """One registered local buffer, and one-sided writes from it into a connected peer's."""

    def info(self) -> dict[str, Any]: ...  # JSON: how a peer reaches this engine's registered memory

    def connect(self, peer: dict[str, Any]) -> None: ...

    def write(self, local_offset: int, remote_offset: int, nbytes: int, timeout_s: float) -> None: ...

    def close(self) -> None: ...


def check_range(buffer: Any, offset: int, nbytes: int) -> None:
    """ValueError unless [offset, offset + nbytes) lies in `buffer`: a write must not send the process's
    memory past its registered buffer."""
    if not (offset >= 0 and nbytes >= 0 and offset + nbytes <= buffer.nbytes):
        raise ValueError(f"{nbytes} bytes at offset {offset} do not lie in the {buffer.nbytes}-byte buffer")


def _missing(kind: str, exc: ImportError) -> TransportError:
    return TransportError(f"the {kind} adapter needs {PACKAGES[kind]} installed: {exc}")


def engine_for(kind: str, buffer: Any, **options: Any) -> RemoteWriter:
    """A writer of `kind` ("mooncake" | "nixl") over `buffer` (a writable numpy uint8 array,
    registered for its lifetime). TransportError when the library is missing or refuses."""
    if kind == "mooncake":
        return MooncakeWriter(buffer, **options)
    if kind == "nixl":
        return NixlWriter(buffer, **options)
    raise ValueError(f"unknown engine {kind!r}; one of {sorted(PACKAGES)}")


class MooncakeWriter:
    """Mooncake TransferEngine, P2P handshake (no metadata server). protocol: "tcp" here,
    "rdma" with RDMA NICs (then `device` names them, e.g. "mlx5_0")."""

    def __init__(self, buffer: Any, *, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise _missing("mooncake", exc) from None
        self.host = host
        self.buf = buffer
        self.engine = TransferEngine()
        if (ret := self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)) != 0:
            raise TransportError(f"Mooncake TransferEngine.initialize({host!r}, {protocol!r}) returned {ret}")
        if (ret := self.engine.register_memory(buffer.ctypes.data, buffer.nbytes)) != 0:
            raise TransportError(f"Mooncake register_memory returned {ret}")
        self.peer: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        return {"session": f"{self.host}:{self.engine.get_rpc_port()}", "base": self.buf.ctypes.data}

    def connect(self, peer: dict[str, Any]) -> None:
        self.peer = peer  # the segment opens on the first write (P2P handshake)

    def write(self, local_offset: int, remote_offset: int, nbytes: int, timeout_s: float) -> None:
        # transfer_sync_write has no deadline of its own (a blocking C call: `timeout_s` cannot bound it); a
        # dead peer fails it at Mooncake's own transport timeout
        check_range(self.buf, local_offset, nbytes)
        src = self.buf.ctypes.data + local_offset
        ret = self.engine.transfer_sync_write(self.peer["session"], src, self.peer["base"] + remote_offset, nbytes)
        if ret != 0:
            raise TransportError(f"Mooncake transfer_sync_write of {nbytes} bytes returned {ret}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.unregister_memory(self.buf.ctypes.data)


class NixlWriter:
    """A NIXL agent with the UCX backend. Here UCX_TLS=tcp (set unless the caller set it) and
    UCX_MODULES=^ib; with RDMA NICs leave UCX_TLS to UCX (rc, ud, cuda_ipc ...)."""

    def __init__(self, buffer: Any, *, name: str = "", ucx_tls: str = "tcp") -> None:
        os.environ.setdefault("UCX_TLS", ucx_tls)
        os.environ.setdefault("UCX_MODULES", "^ib")  # no verbs module on a machine without it
        try:
            try:
                from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found,unused-ignore]
            except ImportError:
                from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise _missing("nixl", exc) from None
        self.name = name or f"prfaas-{os.getpid()}-{id(self):x}"
        self.buf = buffer
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self.reg = self.agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
        self.remote = ""
        self.peer: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        meta = base64.b64encode(self.agent.get_agent_metadata()).decode()
        return {"name": self.name, "meta": meta, "base": self.buf.ctypes.data}

    def connect(self, peer: dict[str, Any]) -> None:
        self.peer = peer
        remote = self.agent.add_remote_agent(base64.b64decode(peer["meta"]))
        self.remote = remote.decode() if isinstance(remote, bytes) else str(remote)
        self.agent.make_connection(self.remote)

    def write(self, local_offset: int, remote_offset: int, nbytes: int, timeout_s: float) -> None:
        check_range(self.buf, local_offset, nbytes)
        local = self.agent.get_xfer_descs([(self.buf.ctypes.data + local_offset, nbytes, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(self.peer["base"] + remote_offset, nbytes, 0)], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.remote, b"prfaas")
        deadline = time.monotonic() + timeout_s
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"NIXL WRITE of {nbytes} bytes still in progress after {timeout_s} s")
                time.sleep(0.0002)  # UCX's progress thread moves the data
                state = self.agent.check_xfer_state(handle)
        finally:  # also on a timeout or an error: NIXL aborts a write still in progress as it releases it, so
            with contextlib.suppress(Exception):  # it cannot land after the caller gave up on it
                handle.release()
        if state != "DONE":
            raise TransportError(f"NIXL WRITE ended in state {state}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self.reg)
