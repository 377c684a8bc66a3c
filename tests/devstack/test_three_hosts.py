"""docs/deploy.md, "Three machines by hand", followed step by step in three network namespaces
on a bridge (root): certificates from `prfaas certs init`, Redis with a password, the API with
the registry and a Celery worker under PRFAAS_TLS_*, a prefill and a decode region listening
on all addresses with mutual TLS, links and a tenant through the admin API, a split request
through the official openai client. tiny-llama instead of SmolLM2, for time."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from prfaas.devstack.processes import wait_until
from prfaas.engine.models import prepare_model

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("redis-server") is None, reason="needs root and redis"),
]
BIN = Path(sys.executable).parent
TAG = f"pf{os.getpid() % 10000}"
NET = f"10.90.{os.getpid() % 250 + 1}"
CP, PRE, DEC = f"{NET}.2", f"{NET}.3", f"{NET}.4"
HOSTS = {"cp": (f"{TAG}h2", CP), "pre": (f"{TAG}h3", PRE), "dec": (f"{TAG}h4", DEC)}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def hosts() -> Iterator[None]:
    bridge = f"{TAG}br"
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{NET}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for n, (ns, address) in enumerate(HOSTS.values()):
            _ip("netns", "add", ns)
            _ip("link", "add", f"{TAG}v{n}", "type", "veth", "peer", "name", f"{TAG}e{n}")
            _ip("link", "set", f"{TAG}v{n}", "master", bridge, "up")
            _ip("link", "set", f"{TAG}e{n}", "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", f"{TAG}e{n}")
            _ip("-n", ns, "link", "set", f"{TAG}e{n}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns, _address in HOSTS.values():
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
            for pid in pids.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)


def _run_in(host: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(["ip", "netns", "exec", HOSTS[host][0], *argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def test_the_three_machines_walkthrough_serves_a_split_request_over_mutual_tls(hosts: None, tmp_path: Path) -> None:
    prepare_model("tiny-llama")
    pki = tmp_path / "pki"
    for name, identity, address in (("cp", "prfaas://control-plane/prod", CP), ("pre", "prfaas://prefill/pre-a/1", PRE),
                                    ("dec", "prfaas://decode/dec-a/1", DEC)):  # fmt: skip  # step 1
        subprocess.run([BIN / "prfaas", "certs", "init", "--dir", pki, "--name", name, "--identity", identity,
                        "--san", address], check=True, capture_output=True, timeout=60)  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("PRFAAS_REDIS_URL", None)
    admin, ticket = os.urandom(32).hex(), os.urandom(32).hex()
    cp_env = env | {
        "PRFAAS_REDIS_URL": f"redis://:pw-{ticket[:8]}@{CP}:6379/0", "PRFAAS_MODEL": "tiny-llama",
        "PRFAAS_ADMIN_KEY": admin, "PRFAAS_TICKET_KEY": ticket, "PRFAAS_TLS_CA": str(pki / "ca.pem"),
        "PRFAAS_TLS_CERT": str(pki / "cp.pem"), "PRFAAS_TLS_KEY": str(pki / "cp-key.pem"),
        "PRFAAS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.db'}",
    }  # fmt: skip
    # fmt: off
    procs = [  # step 2
        _run_in("cp", ["redis-server", "--bind", CP, "--port", "6379", "--requirepass", f"pw-{ticket[:8]}",
                       "--save", "", "--appendonly", "no"], env, tmp_path / "redis.log"),
        _run_in("cp", [str(BIN / "uvicorn"), "--factory", "prfaas.control_plane.app:app_from_env", "--host", CP,
                       "--port", "8000"], cp_env | {"PRFAAS_REGISTRY_LISTEN": f"{CP}:7000"}, tmp_path / "api.log"),
        _run_in("cp", [str(BIN / "celery"), "-A", "prfaas.control_plane.worker", "worker", "--pool", "threads",
                       "-c", "4", "--without-gossip", "--without-mingle"], cp_env, tmp_path / "worker.log"),
    ]
    # fmt: on
    for host, name, role in (("pre", "pre-a", "prefill"), ("dec", "dec-a", "decode")):  # step 3
        config = {
            "name": name, "role": role, "instance": "1", "listen": {"grpc": "0.0.0.0:50051", "kv": "0.0.0.0:7400"},
            "control_plane_url": f"{CP}:7000", "model": "tiny-llama", "ticket_key": ticket, "codec": "raw",
            "tls": {"ca": str(pki / "ca.pem"), "cert": str(pki / f"{host}.pem"), "key": str(pki / f"{host}-key.pem")},
        }  # fmt: skip
        (tmp_path / f"{host}.yaml").write_text(yaml.safe_dump(config))
        procs.append(_run_in(host, [str(BIN / "prfaas"), "region", "--config", str(tmp_path / f"{host}.yaml")], env,
                             tmp_path / f"{host}.log"))  # fmt: skip
    url, auth = f"http://{CP}:8000", {"Authorization": f"Bearer {admin}"}
    try:

        def registered() -> list[dict[str, object]]:
            try:
                return list(httpx.get(f"{url}/admin/regions", headers=auth, timeout=5).json())
            except (httpx.HTTPError, ValueError):
                return []

        wait_until(lambda: sum(bool(r["healthy"]) for r in registered()) == 2, 180, 0.5)
        endpoints = {r["name"]: r["instances"][0]["grpc_endpoint"] for r in registered()}  # type: ignore[index]
        assert endpoints == {"pre-a": f"{PRE}:50051", "dec-a": f"{DEC}:50051"}  # advertised: not 0.0.0.0
        link = {"src": "pre-a", "dst": "dec-a", "rtt_ms": 40, "bandwidth_gbps": 0.3}  # step 4
        httpx.put(f"{url}/admin/links", json=link, headers=auth, timeout=5).raise_for_status()
        body = {"name": "t", "allow_placement": True}  # lets a request ask for the split
        tenant = httpx.post(f"{url}/admin/tenants", json=body, headers=auth, timeout=5).json()
        key = httpx.post(f"{url}/admin/tenants/{tenant['id']}/keys", headers=auth, timeout=5).json()["key"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)  # step 5
        reply = client.completions.create(model="tiny-llama", prompt=list(range(100, 400)), max_tokens=4,
                                          extra_body={"prfaas": {"placement": "split"}})  # fmt: skip
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        job = httpx.get(f"{url}/v1/jobs/{reply.id}", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()
        assert (job["placement_chosen"], job["prefill_region"], job["decode_region"]) == ("split", "pre-a", "dec-a")
        assert (job["prefill_instance"], job["decode_instance"]) == ("1", "1") and job["bytes_raw"] > 0
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
