"""`prfaas regions import FILE`: `terraform output -json` of an environment -> registry
entries. The sample is terraform/envs/aws-example/outputs.sample.json (real `terraform
output -json` of literal values shaped like that environment's outputs)."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prfaas.control_plane.fleet.terraform_outputs import OutputsError, parse_outputs

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "terraform" / "envs" / "aws-example" / "outputs.sample.json"
PRFAAS = [sys.executable, "-m", "prfaas.cli.main"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, COLUMNS="200") | (env or {})
    return subprocess.run([*PRFAAS, *args], capture_output=True, text=True, timeout=60, env=full_env, check=False)


def test_sample_outputs_become_three_regions_and_two_links() -> None:
    out = run("regions", "import", str(SAMPLE), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    entries = json.loads(out.stdout)
    regions = {r["name"]: r for r in entries["regions"]}
    assert {n: (r["role"], r["location"], r["usd_per_gpu_hour"]) for n, r in regions.items()} == {
        "prefill-use2": ("prefill", "us-east-2", 1.86),
        "prefill-usw2": ("prefill", "us-west-2", 1.86),
        "decode-use1": ("decode", "us-east-1", 12.29),
    }
    assert regions["decode-use1"]["cidr"] == "10.20.0.0/16" and regions["decode-use1"]["grpc_endpoint"] is None
    assert entries["links"] == [
        {"src": "prefill-use2", "dst": "decode-use1", "rtt_ms": 12.0, "bandwidth_gbps": 5.0, "egress_usd_per_gb": 0.02},
        {"src": "prefill-usw2", "dst": "decode-use1", "rtt_ms": 65.0, "bandwidth_gbps": 5.0, "egress_usd_per_gb": 0.02},
    ]
    assert entries["control_plane"]["registry_target"].endswith(":7000")


def test_the_table_names_every_region_and_link() -> None:
    out = run("regions", "import", str(SAMPLE))
    assert out.returncode == 0, out.stdout
    for name in ("prefill-use2", "prefill-usw2", "decode-use1", "prefill-use2 -> decode-use1"):
        assert name in out.stdout


def _sample() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SAMPLE.read_text())
    return data


def _broken(path: str, value: Any) -> str:
    """The sample with the value at dotted `path` replaced (`None` deletes the key)."""
    data = copy.deepcopy(_sample())
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is None:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return json.dumps(data)


DEC = "regions.value.decode-use1"
ROLES = "Input should be 'prefill', 'decode' or 'both'"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
        ("[1, 2]", "expected a JSON object of outputs"),
        ("{}", "no `regions` output"),
        # `terraform output -json regions` prints the bare value, without the output wrapper
        (json.dumps({"regions": {"a": 1}}), "output `regions` has no `value`"),
        (_broken("regions.value", {}), "regions: expected a non-empty object"),
        (_broken(f"{DEC}.role", "cache"), f"regions.decode-use1.role: {ROLES}"),
        (_broken(f"{DEC}.usd_per_gpu_hour", -1), "regions.decode-use1.usd_per_gpu_hour: Input should be greater than"),
        (_broken(f"{DEC}.name", "decode-x"), "regions.decode-use1: entry is named 'decode-x'"),
        (_broken(f"{DEC}.gpu_type", None), "regions.decode-use1.gpu_type: Field required"),
        (_broken(f"{DEC}.colour", "red"), "regions.decode-use1.colour: Extra inputs are not permitted"),
        (_broken("links.value", {"src": "a"}), "links: expected a list of links"),
        (_broken("links.value.0.dst", "decode-nowhere"), "links.0.dst: 'decode-nowhere' is not a decode region of"),
        (_broken("links.value.1.src", "decode-use1"), "links.1: Value error, link from 'decode-use1' to itself"),
        (_broken("links.value.0.src", "prefill-usw2"), None),  # two links from one prefill region are fine
        (_broken("links.value.0.rtt_ms", "fast"), "links.0.rtt_ms: Input should be a valid number"),
        (_broken("control_plane.value.api_url", "ftp://x"), "control_plane.api_url: String should match pattern"),
    ],
)  # fmt: skip
def test_malformed_outputs_get_a_clear_error(text: str, message: str | None) -> None:
    if message is None:
        assert len(parse_outputs(text).links) == 2
        return
    with pytest.raises(OutputsError) as err:
        parse_outputs(text)
    assert str(err.value).startswith(message), str(err.value)


def test_a_bad_file_exits_2_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "outputs.json"
    bad.write_text(_broken("regions.value.prefill-use2.role", "gpu"))
    out = run("regions", "import", str(bad))
    assert out.returncode == 2
    assert "regions.prefill-use2.role: Input should be 'prefill', 'decode' or 'both'" in out.stdout
    missing = run("regions", "import", str(tmp_path / "absent.json"))
    assert missing.returncode == 2 and "No such file or directory" in missing.stdout


def test_apply_without_a_reachable_control_plane_exits_1(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = run("regions", "import", str(SAMPLE), "--apply", "--url", url, env={"PRFAAS_ADMIN_KEY": "k" * 40})
    assert out.returncode == 1 and f"cannot reach {url}" in out.stdout, out.stdout
    no_key = run("regions", "import", str(SAMPLE), "--apply", env={"PRFAAS_ADMIN_KEY": ""})
    assert no_key.returncode == 2 and "needs the admin key" in no_key.stdout


def _module_text(module: str) -> str:
    return "".join(p.read_text() for p in sorted((REPO / "terraform" / "modules" / module).glob("*.tf")))


def _variables(module: str) -> set[str]:
    return set(re.findall(r'^variable "(\w+)"', _module_text(module), re.M))


def _object_attributes(module: str, variable: str) -> set[str]:
    """The attributes of an object-typed variable of `module`."""
    text = _module_text(module)
    block = re.search(rf'^variable "{variable}" \{{.*?type = object\(\{{(.*?)\n  \}}\)', text, re.S | re.M)
    assert block is not None, (module, variable)
    return set(re.findall(r"^\s+(\w+)\s+=", block.group(1), re.M))


def _entry_keys() -> set[str]:
    """region_config's output `entry`: the `registry` object merged with four interface attributes."""
    entry = re.search(
        r'^output "entry" \{.*?merge\(var\.registry, \{(.*?)\n  \}\)', _module_text("region_config"), re.S | re.M
    )
    assert entry is not None
    return _object_attributes("region_config", "registry") | set(re.findall(r"^\s+(\w+)\s+=", entry.group(1), re.M))


def test_region_modules_share_one_interface_and_the_importer_reads_it() -> None:
    keys = _entry_keys()
    assert set(parse_outputs(SAMPLE.read_text()).regions[0].model_dump()) == keys
    shared = {
        "name", "role", "gpu_type", "usd_per_gpu_hour", "model", "workers", "kv_buffer_bytes", "codec", "dtype",
        "grpc_port", "kv_port", "metrics_port", "ticket_key_id", "heartbeat_interval_s", "drain_timeout_s",
    }  # fmt: skip
    assert _object_attributes("region_config", "region") == shared
    # declared once: the host modules take the object and pass it to region_config unchanged in shape
    for module in ("region_local", "region_aws"):
        assert not shared & _variables(module), module
        assert {"region", "control_plane_url"} <= _variables(module), module
        config = re.search(r'module "config" \{(.*?)\n\}', _module_text(module), re.S)
        assert config is not None and 'source = "../region_config"' in " ".join(config.group(1).split()), module
        # the registry entry too: both `region` outputs are region_config's `entry`
        output = re.search(r'output "region" \{(.*?)\n\}', _module_text(module), re.S)
        assert output is not None and "value = module.config.entry" in " ".join(output.group(1).split()), module
