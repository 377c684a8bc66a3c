"""`prfaas up` / `prfaas down`: a whole deployment of a topology on one machine.

Redis (PRFAAS_REDIS_URL when it answers, else a private `redis-server` on a free port), the
API (uvicorn, which also serves the region registry), Celery workers and one `prfaas region`
per instance of each topology region (`instances`; with `--hosts` a decode region runs at
least two, each in a network namespace of its own), each started in a process group of its
own; then the demo tenant, its key and the topology's links. The control plane's database (the ledger,
the tenants and their keys) is `$PRFAAS_HOME/deployments/NAME/control-plane.db` (SQLite), kept by `down`:
a second `up` of the topology finds its tenants and their usage again, and the demo tenant, created once,
keeps its key (`demo-tenant.json` beside the database, mode 0600). Every link between components
runs mutual TLS with certificates made for the deployment (pki.py), unless `--insecure`.
`$PRFAAS_HOME/up.json` (mode 0600) holds what a client needs (`api_base`, `api_key`,
`admin_key`, `dashboard_url`) and what `down` needs (process groups, network namespaces, the
Redis key prefix). `down` stops every group (SIGTERM, then SIGKILL after a deadline), removes
the namespaces and the file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis

from prfaas.devstack.network import LoopbackNetwork, Network, WanMesh
from prfaas.devstack.pki import DeploymentPki
from prfaas.devstack.preflight import policy_yaml
from prfaas.devstack.processes import (
    api_argv,
    beat_argv,
    free_port,
    http_ok,
    log_cause,
    spawn_region,
    stop_group,
    wait_until,
    worker_argv,
    write_region_config,
)
from prfaas.devstack.state import UpError, UpState, keep_previous, state_path, stop_state, write_state
from prfaas.devstack.tenant import demo_tenant
from prfaas.devstack.topology import Topology, region_config
from prfaas.telemetry.tracing import TRACE_DIR_ENV
from prfaas.transport.endpoints import hostport

START_TIMEOUT_S = 180.0


def _redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        ok = bool(client.ping())
        client.close()
        return ok
    except (redis.RedisError, ValueError):
        return False


def _private_database(path: Path) -> Path:
    """`path`, an SQLite file made 0600 in a 0700 folder before the control plane opens it (SQLite gives its
    -wal and -shm files the database's mode); one an earlier run left wider is narrowed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    path.touch(mode=0o600)
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            file.chmod(0o600)
    return path


class Deployment:
    """Starts the processes of one topology; `stop()` (also after a failed start) removes all of them."""

    def __init__(
        self,
        topology: Topology,
        topology_path: str,
        home: Path,
        emulate_wan: bool,
        say: Callable[[str], None],
        *,
        hosts: bool = False,
        insecure: bool = False,
    ) -> None:
        self.topology = topology
        self.home = home
        self.say = say
        self.run_dir = home / "up"
        self.data_dir = home / "deployments" / topology.name  # outlives the run: its database, the demo key
        self.trace_dir = self.run_dir / "traces"  # every process's spans (telemetry/spans.py)
        self.admin_key = secrets.token_urlsafe(32)
        self.ticket_key = secrets.token_urlsafe(32)
        self.insecure = insecure
        if (emulate_wan or hosts) and os.geteuid() != 0:
            say("--emulate-wan and --hosts need root (network namespaces, TUN devices); running on loopback")
            emulate_wan = hosts = False
        emulate_wan = emulate_wan or hosts  # hosts of their own are joined by the emulated WAN
        # how many instances each region runs: --hosts gives a decode region two at least
        self.instances = {
            r.name: max(r.instances, 2 if hosts and r.role == "decode" else 1) for r in topology.regions
        }  # fmt: skip
        self.network: Network = WanMesh(topology, self.run_dir, self.instances) if emulate_wan else LoopbackNetwork()
        self.pki: DeploymentPki | None = None
        self.state = UpState(
            api_base="", api_key="", admin_key=self.admin_key, dashboard_url="", url="", tenant_id="", registry="",
            topology=topology_path, redis_url="", key_prefix=f"prfaas-up-{topology.name}", log_dir=str(self.run_dir),
            emulate_wan=emulate_wan, supervisor_pid=os.getpid(), api_drain_s=topology.control_plane.shutdown_timeout_s,
        )  # fmt: skip
        self.state.record(os.getpid())
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self._argv: dict[str, tuple[list[str], dict[str, str]]] = {}  # how each non-region process was started
        self.lock = threading.Lock()
        self.stopping = False

    # ------------------------------------------------------------------ start

    def start(self) -> UpState:
        keep_previous(self.run_dir)
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)  # up.json in it holds the admin key
        self.run_dir.mkdir(parents=True)
        write_state(self.home, self.state)  # from here on `prfaas down` can clean up a half-started deployment
        if not self.insecure:
            nodes = [(r.role, r.name, str(k)) for r in self.topology.regions for k in range(self.instances[r.name])]
            self.pki = DeploymentPki(self.run_dir / "pki", self.topology.name, nodes)
            self.say(f"mutual TLS between components: certificates in {self.pki.folder}")
        self._start_redis()
        try:
            self.network.setup(self._network_grew)
        except (OSError, subprocess.SubprocessError) as exc:  # SubprocessError: a sysctl or the build failed
            raise UpError(f"cannot build the emulated WAN: {exc}") from None
        finally:  # what a failed setup created is removed by stop()
            self._network_grew()
        self._start_control_plane()
        instances = [(name, k) for name, count in self.instances.items() for k in range(count)]
        pool = ThreadPoolExecutor(len(instances))  # model loads overlap
        try:
            list(pool.map(lambda instance: self._start_region(*instance), instances))
        finally:  # an error or a signal: stop() ends the regions still loading (their groups are recorded)
            pool.shutdown(wait=False, cancel_futures=True)
        self.say(f"waiting for {len(instances)} region instances to register")
        wanted = {f"{name}/{k}" for name, k in instances}
        try:
            wait_until(lambda: not self._fail_if_dead() and self._healthy() >= wanted, 60, 0.2)
        except AssertionError:
            missing = sorted(wanted - self._healthy())
            raise UpError(f"instances not healthy after 60 s: {', '.join(missing)} (logs in {self.run_dir})") from None
        self._configure()
        self._fail_if_dead()  # "up" only with every process running
        write_state(self.home, self.state)
        return self.state

    def _network_grew(self) -> None:
        """Write each namespace, device and emulator the network names to up.json as it comes: a SIGKILL
        mid-setup (no `finally` runs) leaves `prfaas down` all of them to remove."""
        self.state.namespaces, self.state.devices = list(self.network.namespaces), list(self.network.devices)
        for name, pid in self.network.groups.items():  # with their start times: `down` signals only these
            if self.state.groups.get(name) != pid:
                self.state.groups[name] = pid
                self.state.record(pid)
        write_state(self.home, self.state)

    def _fail_if_dead(self) -> bool:
        """Raises UpError naming each process that exited while the deployment started, and why (its log)."""
        dead = self.dead()
        if dead:
            why = "; ".join(f"{name} exited with status {self.procs[name].returncode}: "
                            f"{log_cause(self.run_dir / f'{name}.log')}" for name in dead)  # fmt: skip
            raise UpError(f"{why} (logs in {self.run_dir})")
        return False

    def _popen(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[Any]:
        self._argv[name] = (argv, env)
        with (self.run_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        self.state.groups[name] = proc.pid
        self.state.record(proc.pid)
        write_state(self.home, self.state)
        return proc

    def _start_redis(self) -> None:
        url = os.environ.get("PRFAAS_REDIS_URL")
        if url and _redis_answers(url):
            self.state.redis_url = url
            self.state.key_prefix += f"-{secrets.token_hex(4)}"  # a shared server: keys of our own
            self.say(f"redis: {url} (key prefix {self.state.key_prefix})")
            return
        binary = shutil.which("redis-server")
        if url and binary is not None:
            self.say(f"PRFAAS_REDIS_URL={url} does not answer: a private redis-server is started instead")
        if binary is None:
            hint = f"PRFAAS_REDIS_URL={url} does not answer; " if url else ""
            raise UpError(
                f"{hint}no Redis: set PRFAAS_REDIS_URL to a reachable server, or install redis-server "
                "(Debian/Ubuntu: `sudo apt-get install redis-server`; macOS: `brew install redis`)"
            )
        port = free_port()
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.run_dir)]  # fmt: skip
        self._popen("redis", argv, dict(os.environ))
        self.state.redis_url = f"redis://127.0.0.1:{port}/0"
        self.state.private_redis = True
        try:
            wait_until(lambda: _redis_answers(self.state.redis_url), 20, 0.05)
        except AssertionError:
            raise UpError(f"redis-server did not answer on port {port} (log {self.run_dir / 'redis.log'})") from None
        self.say(f"redis: private redis-server on port {port}")

    def _cp_env(self) -> dict[str, str]:
        policy = self.run_dir / "policy.yaml"
        policy.write_text(policy_yaml(self.topology))
        env = dict(
            os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PRFAAS_REDIS_URL=self.state.redis_url,
            PRFAAS_KEY_PREFIX=self.state.key_prefix, PRFAAS_ADMIN_KEY=self.admin_key,
            PRFAAS_TICKET_KEY=self.ticket_key, PRFAAS_POLICY_PATH=str(policy), PRFAAS_MODEL=self.topology.model,
        )  # fmt: skip
        if "PRFAAS_LEDGER_URL" not in env:  # the database `up` keeps: tenants, key digests, the ledger
            env["PRFAAS_LEDGER_URL"] = f"sqlite:///{_private_database(self.data_dir / 'control-plane.db')}"
        env.pop("PRFAAS_DEV", None)
        env[TRACE_DIR_ENV] = str(self.trace_dir)  # `prfaas trace JOB_ID` reads the spans there
        if self.pki is not None:
            env |= self.pki.control_plane_env()
        else:  # --insecure: plaintext off loopback too, as its regions' `insecure: true`
            env["PRFAAS_REGISTRY_INSECURE"] = "1"
        env["PRFAAS_SHUTDOWN_TIMEOUT_S"] = str(self.topology.control_plane.shutdown_timeout_s)  # its drain
        if self.topology.control_plane.ttft_slo_ms is not None:
            env["PRFAAS_TTFT_SLO_MS"] = str(self.topology.control_plane.ttft_slo_ms)
        return env

    def _start_control_plane(self) -> None:
        cp = self.topology.control_plane
        env = self._cp_env()
        host = self.network.registry_host
        self.state.registry = f"{host}:{cp.registry_port or free_port(host)}"
        port = cp.api_port or free_port(cp.host)
        self._popen("api", api_argv(cp.host, port), env | {"PRFAAS_REGISTRY_LISTEN": self.state.registry})
        self.state.url = f"http://{hostport(cp.host, port)}"
        self.state.api_base = self.state.url + "/v1"
        for i in range(cp.workers):
            self._popen(f"worker-{i + 1}", worker_argv(f"{self.topology.name}-w{i + 1}", cp.worker_concurrency), env)
        self._popen("beat", beat_argv(self.run_dir / "beat-schedule"), env)  # bills what a dead API left unbilled
        try:
            wait_until(lambda: self._alive("api") and http_ok(self.state.url + "/readyz"), 60, 0.1)
        except AssertionError:
            log = self.run_dir / "api.log"
            raise UpError(f"api not ready after 60 s: {log_cause(log)} (log {log})") from None
        self.say(f"control plane: {self.state.url} (registry {self.state.registry})")

    def _alive(self, name: str) -> bool:
        if self.procs[name].poll() is not None:
            log = self.run_dir / f"{name}.log"
            raise UpError(f"{name} exited with status {self.procs[name].returncode}: {log_cause(log)} (log {log})")
        return True

    def _process(self, name: str, k: int) -> str:
        """`region-NAME` (one instance), `region-NAME-K` (several): its process, config and log name."""
        return f"region-{name}" if self.instances[name] == 1 else f"region-{name}-{k}"

    def _start_region(self, name: str, k: int) -> None:
        spec = next(r for r in self.topology.regions if r.name == name)
        grpc, kv = self.network.instance_listen(name, k)
        config = region_config(self.topology, spec, instance=str(k), ticket_key=self.ticket_key, ticket_key_id="k1",
                               listen={"grpc": grpc, "kv": kv}, control_plane_url=self.state.registry)  # fmt: skip
        if self.pki is not None:
            config["tls"] = self.pki.instance(name, str(k))
        else:
            config["insecure"] = True  # off loopback too, as --insecure asked
        process = self._process(name, k)
        path = write_region_config(self.run_dir / f"{process}.yaml", config)
        log = self.run_dir / f"{process}.log"
        timeout_s = START_TIMEOUT_S
        vllm = config.get("vllm")
        if config.get("engine") == "vllm":  # the region waits for its vLLM server first
            timeout_s += float(vllm.get("start_timeout_s", 600.0) if isinstance(vllm, dict) else 600.0)

        def spawned(proc: subprocess.Popen[Any]) -> None:  # recorded at once: stop() ends it while it loads
            with self.lock:
                self.procs[process] = proc
                if self.stopping:  # stop() is running: this one is ours to end (its groups are not touched)
                    stop_group(proc.pid, 5.0)
                    return
                self.state.groups[process] = proc.pid
                self.state.record(proc.pid)
                write_state(self.home, self.state)

        try:
            region = spawn_region(path, timeout_s, argv_prefix=self.network.argv_prefix(name, k), log=log,
                                  new_session=True, env={TRACE_DIR_ENV: str(self.trace_dir)},
                                  on_spawn=spawned)  # fmt: skip
        except RuntimeError as exc:
            raise UpError(str(exc)) from None
        with self.lock:
            if self.stopping:
                raise UpError(f"{process}: the deployment is stopping")
            self.state.regions[f"{name}/{k}"] = region.grpc
            write_state(self.home, self.state)
        which = f"region {name}" if self.instances[name] == 1 else f"region {name} instance {k}"
        self.say(
            f"{which} ({spec.role}, ${spec.usd_per_gpu_hour}/GPU-h, {region.device or '?'}): grpc {region.grpc} "
            f"kv {region.kv}"
        )

    def _admin(self, method: str, path: str, body: object = None) -> Any:
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        reply = httpx.request(method, self.state.url + path, json=body, headers=headers, timeout=10)
        if reply.status_code >= 400:
            raise UpError(f"{method} {path}: HTTP {reply.status_code} {reply.text}")
        return None if reply.status_code == 204 else reply.json()

    def _healthy(self) -> set[str]:
        """`region/instance` of every healthy instance."""
        regions = self._admin("GET", "/admin/regions")
        return {f"{r['name']}/{i['instance']}" for r in regions for i in r["instances"] if i["healthy"]}

    def _configure(self) -> None:
        wanted = {(link.src, link.dst) for link in self.topology.links}
        for kept in self._admin("GET", "/admin/links"):  # the deployment's database keeps links across runs
            if (kept["src"], kept["dst"]) not in wanted:
                self._admin("DELETE", f"/admin/links/{kept['src']}/{kept['dst']}")
        for link in self.topology.links:
            self._admin("PUT", "/admin/links", {
                "src": link.src, "dst": link.dst, "rtt_ms": link.rtt_ms, "bandwidth_gbps": link.rate_mbit / 1000,
                "egress_usd_per_gb": link.egress_usd_per_gb,
            })  # fmt: skip
        self.state.tenant_id, self.state.api_key = demo_tenant(
            self._admin, self.topology.tenant, self.data_dir, self.say
        )
        dashboard = self.state.url + "/dashboard"
        try:  # the route may ask for a key; only a 404 means there is none
            served = httpx.get(dashboard, timeout=5).status_code != 404
        except httpx.HTTPError:
            served = False
        self.state.dashboard_url = dashboard if served else self.state.url + "/docs"

    # ------------------------------------------------------------------ faults (bench/chaos.py)

    def kill(self, name: str) -> None:
        """SIGKILL process `name` (`api`, `worker-1`, `region-NAME[-K]`) and its group."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def restart(self, name: str) -> None:
        """Start process `name` again as it was started (the API on its port, a region instance with its config),
        as a supervisor would; returns once it serves. UpError once `stop` began (then nothing starts)."""
        if name.startswith("region-"):
            region, k = next((r, k) for r, count in self.instances.items() for k in range(count)
                             if self._process(r, k) == name)  # fmt: skip
            self._start_region(region, k)  # a region spawned once `stop` began is stopped at once
            return
        with self.lock:  # recorded before `stop` reads the groups, or not started at all
            if self.stopping:
                raise UpError(f"{name} not started again: the deployment is stopping")
            self._popen(name, *self._argv[name])
        serves = {"api": lambda: self._alive("api") and http_ok(self.state.url + "/readyz"),
                  "redis": lambda: _redis_answers(self.state.redis_url)}  # a private Redis: back empty  # fmt: skip
        if name in serves:
            wait_until(serves[name], 60, 0.1)

    def cut_link(self, src: str, dst: str, cut: bool) -> bool:
        """Cut (drop every packet both ways) or restore the emulated link `src -> dst`; False
        when it is not emulated (no --emulate-wan)."""
        return self._signal_link(src, dst, signal.SIGRTMIN if cut else signal.SIGRTMIN + 1)

    def slow_link(self, src: str, dst: str, slow: bool) -> bool:
        """Slow the emulated link `src -> dst` to 1/10 of its rate, or give it its rate back."""
        return self._signal_link(src, dst, signal.SIGRTMIN + 2 if slow else signal.SIGRTMIN + 3)

    def _signal_link(self, src: str, dst: str, sig: int) -> bool:
        pid = self.network.link_emulator(src, dst)
        if pid is not None:
            os.kill(pid, sig)
        return pid is not None

    # ------------------------------------------------------------------ watch and stop

    def dead(self) -> list[str]:
        """Names of processes that exited on their own."""
        return [name for name, proc in self.procs.items() if proc.poll() is not None]

    def exit_status(self, name: str) -> int | None:
        return self.procs[name].returncode

    def stop(self) -> None:
        with self.lock:  # no region starting now records its group after this (it is stopped at once instead)
            self.stopping = True
        stop_state(self.state, self.say)
        with contextlib.suppress(FileNotFoundError):
            state_path(self.home).unlink()
