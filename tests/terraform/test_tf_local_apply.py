"""terraform/envs/local applied for real: `terraform apply` (inside a network namespace with
only loopback) starts the control plane (its own Redis, the API, a Celery worker) and one
prefill and one decode region; `prfaas regions import --apply` configures the link from the
environment's outputs; one long prompt goes through the API with the official `openai`
client and is split; its tokens equal a colocated run's; `terraform destroy` leaves no
process behind."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from tf_kit import NETNS, copy_tree, have_terraform, in_netns, kill_all, netns_pids

from prfaas.control_plane.scheduling.policy import DEFAULT_POLICY_YAML
from prfaas.engine.hf import HFEngine
from prfaas.engine.models import prepare_model
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.stops import output_text

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not have_terraform(), reason="needs terraform on PATH and root (ip netns)"),
]
HERE = Path(__file__).resolve().parent
MAX_TOKENS = 8


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_apply_serves_a_split_request_and_destroy_leaves_no_process(tmp_path: Path, long_text: str) -> None:
    prepare_model("tiny-llama")
    engine = HFEngine("tiny-llama")
    tree = copy_tree(tmp_path / "terraform")
    env_dir = tree / "envs" / "local"
    run_dir = tmp_path / "run"
    policy = tmp_path / "policy.yaml"
    # the default threshold (19,400 uncached tokens) is for production fleets; tiny-llama's
    # context is 2,048, so split from 200 tokens as the other end-to-end tests do
    policy.write_text(DEFAULT_POLICY_YAML.replace("min_uncached_tokens: 19400", "min_uncached_tokens: 200"))
    # hex: never contains a word the settings refuse as a placeholder ("xxx", "secret", ...)
    admin_key = secrets.token_hex(24)
    env = {
        "TF_VAR_python": sys.executable, "TF_VAR_run_dir": str(run_dir), "TF_VAR_admin_key": admin_key,
        "TF_VAR_ticket_key": secrets.token_hex(24), "TF_VAR_policy_file": str(policy),
        "PRFAAS_ADMIN_KEY": admin_key,
    }  # fmt: skip
    ns = f"prfaas-tft-{uuid.uuid4().hex[:8]}"
    subprocess.run([str(NETNS), "create", ns], check=True, timeout=30)
    pids: list[int] = []
    try:
        links = in_netns(ns, ["ip", "-o", "link"], env_dir).stdout.splitlines()
        assert [line.split(":")[1].strip() for line in links] == ["lo"]  # no route off this host
        in_netns(ns, ["terraform", "init", "-input=false", "-no-color"], env_dir, env, timeout_s=60)
        start = time.monotonic()
        in_netns(ns, ["terraform", "apply", "-auto-approve", "-input=false", "-no-color"], env_dir, env)
        apply_s = time.monotonic() - start
        pids = [int(p.read_text().split()[0]) for p in run_dir.glob("*.pid")]
        assert len(pids) == 6, sorted(p.name for p in run_dir.glob("*.pid"))  # redis, api, worker, beat, 2 regions
        assert sorted(netns_pids(ns)) == sorted(pids)  # every process lives in the namespace

        outputs = in_netns(ns, ["terraform", "output", "-json"], env_dir, env).stdout
        (tmp_path / "outputs.json").write_text(outputs)
        api_url = json.loads(outputs)["control_plane"]["value"]["api_url"]
        importer = [sys.executable, "-m", "prfaas.cli.main", "regions", "import", str(tmp_path / "outputs.json")]
        deadline = time.monotonic() + 30
        while True:  # the regions register at their first heartbeat
            report = in_netns(ns, [*importer, "--apply"], tmp_path, env | {"COLUMNS": "200"}).stdout
            if "not yet: none" in report or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert "put 1 link(s)" in report and "healthy: decode-local, prefill-local; not yet: none" in report, report

        prompt = engine.encode(long_text)[:600]
        client = [sys.executable, str(HERE / "tf_client.py"), api_url, admin_key, str(MAX_TOKENS)]
        reply = json.loads(in_netns(ns, client, tmp_path, env, timeout_s=180, stdin=json.dumps(prompt)).stdout)
        colocated = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_TOKENS))
        assert reply["text"] == output_text(engine.decode_text, colocated)
        assert (reply["prompt_tokens"], reply["completion_tokens"]) == (len(prompt), len(colocated))
        job = reply["job"]
        assert job["placement_chosen"] == "split", job
        assert (job["prefill_region"], job["decode_region"]) == ("prefill-local", "decode-local")
        assert [e["state"] for e in job["timeline"]] == ["QUEUED", "PREFILLING", "TRANSFERRING", "DECODING", "DONE"]
    finally:
        destroy = subprocess.run(
            [str(NETNS), "exec", ns, "terraform", "destroy", "-auto-approve", "-input=false", "-no-color"],
            cwd=env_dir, env=dict(os.environ) | env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        left = kill_all(ns)  # never leak: what destroy missed is killed, and the test fails below
        subprocess.run([str(NETNS), "delete", ns], timeout=30)
    assert destroy.returncode == 0, destroy.stdout[-3000:] + destroy.stderr[-3000:]
    assert left == [], f"processes left in the namespace after destroy: {left}"
    assert not [pid for pid in pids if _alive(pid)]
    assert not list(run_dir.glob("*.pid"))
    print(f"apply took {apply_s:.1f} s")
