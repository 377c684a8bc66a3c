"""Topology files (`prfaas up --topology`): the example is valid; every bad field is named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prfaas.devstack.topology import (
    DEFAULT_TOPOLOGY,
    TopologyError,
    load_topology,
    parse_topology,
    region_config,
    split_topology,
    write_topology,
)

GOOD = {
    "regions": [
        {"name": "p", "role": "prefill", "usd_per_gpu_hour": 1.0},
        {"name": "d", "role": "decode", "usd_per_gpu_hour": 4.0},
    ],
    "links": [{"src": "p", "dst": "d", "rtt_ms": 40, "rate_mbit": 300, "loss_pct": 0.01}],
}


def _with(path: str, value: object) -> str:
    """GOOD with one field replaced; `path` like `regions.0.role`."""
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return yaml.safe_dump(doc)


def test_the_example_topology_is_valid() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY)
    roles = sorted(r.role for r in topology.regions)
    assert roles == ["decode", "prefill", "prefill"]  # two cheap prefill regions, one scarce decode region
    assert topology.link("prefill-cheap-a", "decode-scarce") is not None


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("regions.0.role", "prefil", "regions[0].role: Input should be 'prefill', 'decode' or 'both'"),
        ("regions.1.name", "Decode_1", "regions[1].name: String should match pattern"),
        ("regions.0.usd_per_gpu_hour", -1, "regions[0].usd_per_gpu_hour: Input should be greater than or equal to 0"),
        ("regions.0.pricee", 1, "regions[0].pricee: Extra inputs are not permitted"),
        ("regions.1.kv_buffer_bytes", "lots", "regions[1].kv_buffer_bytes: 'lots' is not a byte count"),
        ("regions.1.kv_buffer_bytes", 0, "regions[1].kv_buffer_bytes: must be more than 0 bytes"),
        ("links.0.dst", "nowhere", "links[0].dst: no region named 'nowhere' (regions: p, d)"),
        ("links.0.src", "d", "links[0].src: region 'd' has role decode, not prefill/both"),
        ("links.0.rtt_ms", -5, "links[0].rtt_ms: Input should be greater than or equal to 0"),
        ("links.0.rate_mbit", 0, "links[0].rate_mbit: Input should be greater than 0"),
        ("links.0.loss_pct", 100, "links[0].loss_pct: Input should be less than 100"),
        ("regions.1.role", "prefill", "no region can decode: at least one needs role decode or both"),
        ("regions.1.name", "p", "region names repeat: p"),
        ("regions", [], "regions: List should have at least 1 item"),
        ("control_plane", {"api_port": 70000}, "control_plane.api_port: Input should be less than or equal to 65535"),
        # the region config fields `extra` adds, checked at load (before, by the region once the rest had started,
        # naming the generated file); a host the API cannot listen on (before, `up failed: gaierror` / OSError)
        ("regions.1.extra", {"dtyp": "bfloat16"}, "regions[1].extra.dtyp: Extra inputs are not permitted"),
        ("regions.1.extra", {"dtype": "float99"}, "regions[1].extra.dtype: Input should be 'auto', 'float32'"),
        ("regions.1.extra", {"engine": "vllm", "shm": True}, "regions[1].extra: engine 'vllm' sends and receives KV"),
        ("control_plane", {"host": "999.1.1.1"}, "control_plane.host: '999.1.1.1' is not an IP address or a DNS"),
        ("control_plane", {"host": "192.0.2.7"}, "control_plane.host: '192.0.2.7': the API cannot listen there"),
    ],
)
def test_a_bad_field_is_named_in_the_error(field: str, value: object, expected: str) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(_with(field, value), "t.yaml")
    assert str(info.value).startswith("t.yaml: invalid topology:\n  ")
    assert expected in str(info.value)
    assert "(top level)" not in str(info.value)  # a rule across fields names them itself


def test_extra_fields_a_region_config_has_are_accepted_and_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRFAAS_TLS__CERT", "/nonexist")  # this process's environment is not the region's config
    topology = parse_topology(_with("regions.1.extra", {"prefix_cache_bytes": "64MiB", "transport": "tcp"}))
    config = region_config(topology, topology.regions[1], instance="0")
    shown = (config["prefix_cache_bytes"], config["transport"], config["name"], config["instance"])
    assert shown == ("64MiB", "tcp", "d", "0")


def test_a_second_link_between_the_same_regions_is_refused() -> None:
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    doc["links"].append(dict(doc["links"][0]))
    with pytest.raises(TopologyError, match=r"links\[1\]: a second link p -> d"):
        parse_topology(yaml.safe_dump(doc))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("regions: [", "t.yaml: not valid YAML"), ("- a\n- b\n", "t.yaml: a topology is a YAML mapping")],
)
def test_a_file_that_is_not_a_topology_says_so(text: str, expected: str) -> None:
    with pytest.raises(TopologyError, match=expected):
        parse_topology(text, "t.yaml")


def test_a_yaml_syntax_error_is_one_line_saying_what_and_where() -> None:
    """It was PyYAML's four-line report, its caret pointing into "<unicode string>"."""
    with pytest.raises(TopologyError) as raised:
        parse_topology("name: demo\nregions: [\n", "t.yaml")
    expected = "expected the node content, but found '<stream end>' (line 3, column 1)"
    assert str(raised.value) == f"t.yaml: not valid YAML: {expected}"


def test_a_split_topology_splits_short_prompts_and_is_written_as_it_reads_back(tmp_path: Path) -> None:
    topology = split_topology("bench", "tiny-llama", GOOD["regions"], GOOD["links"], workers=2, budget_usd=5.0)
    assert topology.policy.min_uncached_tokens == 128  # the benchmarks' prompts are a few hundred tokens
    assert (topology.tenant.name, topology.tenant.budget_usd) == ("bench", 5.0)
    assert topology.control_plane.workers == 2

    write_topology(topology, tmp_path / "t.yaml")

    assert load_topology(tmp_path / "t.yaml") == topology


def test_prfaas_up_with_a_bad_topology_exits_2_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(_with("links.0.dst", "nowhere"))
    env = {**os.environ, "PRFAAS_HOME": str(tmp_path), "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "prfaas.cli.main", "up", "--topology", str(bad)], env=env,
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "links[0].dst: no region named 'nowhere'" in out.stdout
    assert not (tmp_path / "up.json").exists()


def test_emulate_wan_without_root_says_so_and_uses_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prfaas.devstack.deployment import Deployment
    from prfaas.devstack.network import LoopbackNetwork

    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # an ordinary user
    said: list[str] = []
    deployment = Deployment(load_topology(DEFAULT_TOPOLOGY), "t.yaml", tmp_path, True, said.append)
    assert isinstance(deployment.network, LoopbackNetwork)
    assert not deployment.state.emulate_wan
    assert said == ["--emulate-wan and --hosts need root (network namespaces, TUN devices); running on loopback"]
