"""The engine processes of bench/vs_vllm_pd.py: a prefill and a decode vLLM engine
(engine/vllm/server.py) for each of prfaas's KV connector and vLLM's NixlConnector, each pinned
to its core, in its side's network namespace when the link is emulated. Run as a script, this
file is the NIXL engine's server (`serve_nixl`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prfaas.devstack.processes import free_port

START_TIMEOUT_S = 600.0


# ------------------------------------------------------------------ the NIXL engine process


def serve_nixl(argv: list[str]) -> None:
    """engine/vllm/server.py whose NIXL agents have no progress thread. vLLM looks the config
    class up in `nixl._api` when it first needs it (vllm/distributed/nixl_utils.py)."""
    import nixl._api as nixl_api  # type: ignore[import-not-found,unused-ignore]

    base = nixl_api.nixl_agent_config

    class AgentConfig(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["enable_prog_thread"] = False
            super().__init__(*args, **kwargs)

    nixl_api.nixl_agent_config = AgentConfig
    from prfaas.engine.vllm.server import serve

    serve(argv)


# ------------------------------------------------------------------ processes


class Engines:
    """The four engine processes (prfaas and NIXL, prefill and decode), started together."""

    def __init__(self, folder: Path, args: argparse.Namespace, addr_p: str, addr_d: str, ns: dict[str, str]) -> None:
        self.folder, self.args, self.addr_p, self.addr_d, self.ns = folder, args, addr_p, addr_d, ns
        self.authkey, self.ticket_key = secrets.token_bytes(32), secrets.token_bytes(32)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        device = "lo" if self.args.link == "loopback" else "wan0"
        for system in ("prfaas", "nixl"):
            for role, core, addr in (("prefill", 0, self.addr_p), ("decode", 1, self.addr_d)):
                name = f"{system}-{role}"
                env = {
                    **os.environ, "PRFAAS_VLLM_AUTHKEY": self.authkey.hex(), "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": str(core), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "OMP_NUM_THREADS": "1",
                }  # fmt: skip
                serve = [sys.executable, "-m", "prfaas.engine.vllm.server"]
                extra = ["--control-host", addr, "--kv-host", addr]
                if system == "prfaas" and role == "decode":
                    extra += ["--ticket-key", f"k1:{self.ticket_key.hex()}"]
                if system == "nixl":
                    serve = [sys.executable, str(Path(__file__).resolve())]  # serve_nixl
                    config = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu",
                              "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                              "kv_connector_extra_config": {"backends": ["UCX"]}}  # fmt: skip
                    extra += ["--kv-transfer-config", json.dumps(config)]
                    side_port = str(free_port("127.0.0.1"))  # a fresh namespace has every port free
                    env.update(UCX_TLS="tcp", UCX_MODULES="^ib", UCX_NET_DEVICES=device,
                               VLLM_NIXL_SIDE_CHANNEL_HOST=addr, VLLM_NIXL_SIDE_CHANNEL_PORT=side_port)  # fmt: skip
                if self.args.enforce_eager:
                    extra.append("--enforce-eager")
                argv = ["taskset", "-c", str(core), *serve, "--model", self.args.model, "--node", name]
                argv += ["--ready-file", str(self.folder / f"{name}.ready"), *extra]
                netns = self.ns.get(role)
                if netns:
                    argv = ["ip", "netns", "exec", netns, *argv]
                with open(self.folder / f"{name}.log", "wb") as log:
                    self.procs[name] = subprocess.Popen(
                        argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )

    def wait_ready(self) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT_S
        ready: dict[str, Any] = {}
        while len(ready) < len(self.procs):
            for name, proc in self.procs.items():
                path = self.folder / f"{name}.ready"
                if name not in ready and path.exists():
                    ready[name] = json.loads(path.read_text())
                elif proc.poll() is not None:
                    tail = (self.folder / f"{name}.log").read_text(errors="replace")[-4000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode} during start-up:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines not ready in {START_TIMEOUT_S} s (logs in {self.folder})")
            time.sleep(0.5)
        return ready

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


if __name__ == "__main__":
    serve_nixl(sys.argv[1:])
