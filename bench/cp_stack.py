"""The control plane as real processes on loopback, shared by `bench/control_plane.py` and
tests/control_plane/test_api_e2e.py: the API (uvicorn, serving the region registry over
gRPC), Celery workers (Redis broker) and `prfaas region` processes registering through
heartbeats. Redis must already run (tests/ensure-services.sh starts one)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from prfaas.control_plane.policy import DEFAULT_POLICY_YAML

REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN_KEY = "admin-key-for-control-plane-tests-0123456789"
TICKET_KEY = "region-tests-ticket-key-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.02) -> float:
    """Seconds until `predicate()` held; raises AssertionError after `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


@dataclass
class RegionProcess:
    proc: subprocess.Popen[str]
    grpc: str
    kv: str
    metrics: str
    lines: list[str]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def spawn_region(config: Path, timeout_s: float = 120, env: Mapping[str, str] | None = None) -> RegionProcess:
    """Start `prfaas region --config` and wait for its `ready grpc=... kv=...` line."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "prfaas.cli.main", "region", "--config", str(config), "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env | dict(env or {}),
    )  # fmt: skip
    lines: list[str] = []
    ready: dict[str, str] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("ready "):
                for part in line.split()[1:]:
                    name, _, value = part.partition("=")
                    ready[name] = value

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not ready:
        proc.kill()
        raise RuntimeError(f"region {config.name} did not start:\n" + "\n".join(lines[-30:]))
    return RegionProcess(proc, ready["grpc"], ready["kv"], ready["metrics"], lines)


class Stack:
    """Processes of one control plane with a Redis key prefix of its own; `stop()` kills them
    and `cleanup()` removes the prefix's keys."""

    def __init__(self, folder: Path, min_split_tokens: int = 200, **env: str) -> None:
        self.folder = folder
        self.prefix = f"prfaas-e2e-{uuid.uuid4().hex[:8]}"
        self.registry = f"127.0.0.1:{free_port()}"
        policy = folder / "policy.yaml"
        policy.write_text(
            DEFAULT_POLICY_YAML.replace("min_uncached_tokens: 19400", f"min_uncached_tokens: {min_split_tokens}")
        )
        self.env = dict(
            os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PRFAAS_DEV="1", PRFAAS_REDIS_URL=REDIS_URL,
            PRFAAS_KEY_PREFIX=self.prefix, PRFAAS_ADMIN_KEY=ADMIN_KEY, PRFAAS_TICKET_KEY=TICKET_KEY,
            PRFAAS_POLICY_PATH=str(policy), PRFAAS_DISPATCH_VISIBILITY_S="3", PRFAAS_BACKOFF_S="0.05",
            PRFAAS_JOB_TIMEOUT_S="60", PRFAAS_LEDGER_URL=f"sqlite:///{folder / 'ledger.db'}",
        ) | env  # fmt: skip
        self.ledger_url = self.env["PRFAAS_LEDGER_URL"]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.regions: list[RegionProcess] = []
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.api: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start_api(self) -> None:
        port = free_port()
        env = self.env | {"PRFAAS_REGISTRY_LISTEN": self.registry}
        log = (self.folder / f"api-{port}.log").open("wb")
        self.api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "prfaas.control_plane.app:app_from_env",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.procs.append(self.api)
        self.url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 60, 0.1)

    def start_worker(self, name: str, concurrency: int = 4) -> subprocess.Popen[bytes]:
        log = (self.folder / f"worker-{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "prfaas.control_plane.worker", "worker", "--pool", "threads",
             "-c", str(concurrency), "-n", f"{name}@%h", "--without-gossip", "--without-mingle",
             "--loglevel", "WARNING"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.procs.append(proc)
        self.workers[name] = proc
        return proc

    def region(self, name: str, role: str, price: float, **fields: Any) -> RegionProcess:
        """A `prfaas region` of tiny-llama registering with this stack; `fields` override its config."""
        config: dict[str, Any] = {
            "name": name, "role": role, "model": "tiny-llama", "ticket_key": TICKET_KEY, "ticket_key_id": "k1",
            "listen": {"grpc": "127.0.0.1:0", "kv": "127.0.0.1:0", "metrics": "127.0.0.1:0"}, "codec": "raw",
            "heartbeat_interval_s": 0.5, "usd_per_gpu_hour": price, "control_plane_url": self.registry,
            "kv_buffer_bytes": "256MiB",
        } | fields  # fmt: skip
        path = self.folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        region = spawn_region(path, timeout_s=120)
        self.regions.append(region)
        return region

    def put_link(self, src: str, dst: str, rtt_ms: float = 1.0, bandwidth_gbps: float = 10.0) -> None:
        link = {"src": src, "dst": dst, "rtt_ms": rtt_ms, "bandwidth_gbps": bandwidth_gbps}
        httpx.put(self.url + "/admin/links", json=link, headers=ADMIN, timeout=5).raise_for_status()

    def healthy(self) -> list[str]:
        regions = httpx.get(self.url + "/admin/regions", headers=ADMIN, timeout=5).json()
        return [r["name"] for r in regions if r["healthy"]]

    def tenant(self, name: str, **quota: Any) -> tuple[str, str]:
        """A new tenant and one API key for it: (tenant id, key)."""
        body = {"name": name} | quota
        t = httpx.post(self.url + "/admin/tenants", json=body, headers=ADMIN, timeout=5).json()
        key = httpx.post(f"{self.url}/admin/tenants/{t['id']}/keys", headers=ADMIN, timeout=5).json()["key"]
        return str(t["id"]), str(key)

    def stop(self) -> None:
        for region in self.regions:
            region.stop()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def cleanup(self) -> None:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{self.prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
