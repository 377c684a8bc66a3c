"""The control plane as real processes on loopback, for the tests and the benches
(tests/control_plane, tests/transport/test_webrtc_region_e2e.py, bench/control_plane.py,
bench/sim_calibrate.py): the API (uvicorn, serving the region registry over gRPC), Celery
workers (Redis broker) and `prfaas region` processes registering through heartbeats. Redis
must already run (tests/ensure-services.sh starts one). The process helpers (`spawn_region`,
`RegionProcess`, `free_port`, `wait_until`) are processes.py's, re-exported here."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis

from prfaas.control_plane.scheduling.policy import DEFAULT_POLICY_YAML
from prfaas.devstack.processes import (
    LOOPBACK_REGION,
    RegionProcess,
    api_argv,
    free_port,
    http_ok,
    spawn_region,
    wait_until,
    worker_argv,
    write_region_config,
)

__all__ = ["ADMIN", "ADMIN_KEY", "REDIS_URL", "TICKET_KEY", "RegionProcess", "Stack", "free_port", "spawn_region",
           "wait_until"]  # fmt: skip

REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN_KEY = "admin-key-for-control-plane-tests-0123456789"
TICKET_KEY = "region-tests-ticket-key-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


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
        self.api = subprocess.Popen(api_argv("127.0.0.1", port), env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(self.api)
        self.url = f"http://127.0.0.1:{port}"

        wait_until(lambda: http_ok(self.url + "/readyz"), 60, 0.1)

    def start_worker(self, name: str, concurrency: int = 4) -> subprocess.Popen[bytes]:
        log = (self.folder / f"worker-{name}.log").open("wb")
        proc = subprocess.Popen(worker_argv(name, concurrency), env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.workers[name] = proc
        return proc

    def region(self, name: str, role: str, price: float, **fields: Any) -> RegionProcess:
        """A `prfaas region` of tiny-llama registering with this stack; `fields` override its config."""
        config = LOOPBACK_REGION | {
            "name": name, "role": role, "model": "tiny-llama", "ticket_key": TICKET_KEY, "usd_per_gpu_hour": price,
            "control_plane_url": self.registry, "kv_buffer_bytes": "256MiB",
        } | fields  # fmt: skip
        instance = f"-{fields['instance']}" if "instance" in fields else ""  # a region's instances: a file each
        path = write_region_config(self.folder / f"{name}{instance}.yaml", config)
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
