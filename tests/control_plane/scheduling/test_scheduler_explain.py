"""`sched explain` and docs/scheduler.md: the CLI's contract, and docs that cannot drift."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sched_kit import fleet, request

from prfaas.control_plane.scheduling import (
    DEFAULT_POLICY_YAML,
    ClusterSnapshot,
    Cost,
    Decision,
    InvalidSchedulerInput,
    Link,
    ModelShape,
    Region,
    Request,
    Slo,
    StageTrace,
    default_registry,
)
from prfaas.control_plane.scheduling.explain import EXIT_BAD_INPUT, EXIT_REJECTED, explain_json, main
from prfaas.control_plane.scheduling.policy import (
    CodecSpec,
    DisaggregationSpec,
    FilterSpec,
    PolicyConfig,
    ProfileSpec,
    ScorerSpec,
    TransferSpec,
)

DOC = (Path(__file__).resolve().parents[3] / "docs" / "scheduler.md").read_text(encoding="utf-8")


def _block(tag: str) -> str:
    match = re.search(rf"```json {tag}\n(.*?)```", DOC, re.S)
    assert match, f"docs/scheduler.md has no ```json {tag} block"
    return match.group(1)


def _matches(documented: Any, actual: Any, path: str = "") -> None:
    """Every documented value is in the actual output (floats to the documented digits)."""
    if isinstance(documented, dict):
        assert isinstance(actual, dict), path
        for key, value in documented.items():
            assert key in actual, f"{path}.{key} not in output"
            _matches(value, actual[key], f"{path}.{key}")
    elif isinstance(documented, list) and path.endswith("stages"):
        for i, value in enumerate(documented):  # abridged: the last stages
            _matches(value, actual[len(actual) - len(documented) + i], f"{path}[{i}]")
    elif isinstance(documented, float):
        assert actual == pytest.approx(documented, rel=1e-3, abs=1e-6), path
    else:
        assert actual == documented, path


def test_documented_example_gives_the_documented_decision() -> None:
    result = explain_json(_block("snapshot"), _block("request"))
    _matches(json.loads(_block("decision")), result)


def _write(tmp_path: Path, snapshot: ClusterSnapshot, req: Request) -> list[str]:
    (tmp_path / "snap.json").write_text(snapshot.model_dump_json())
    (tmp_path / "req.json").write_text(req.model_dump_json())
    return ["--snapshot", str(tmp_path / "snap.json"), "--request", str(tmp_path / "req.json")]


def test_explain_prints_every_decision_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_write(tmp_path, fleet(), request())) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {f.name for f in dataclasses.fields(Decision)}
    assert set(printed["cost"]) == {f.name for f in dataclasses.fields(Cost)}
    assert (printed["mode"], printed["prefill_region"]) == ("split", "pre-cheap")


def test_explain_uses_the_given_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(DEFAULT_POLICY_YAML.replace("min_uncached_tokens: 19400", "min_uncached_tokens: 50000"))
    assert main([*_write(tmp_path, fleet(), request()), "--config", str(policy)]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "local"  # 40k < 50k


def test_explain_reports_a_rejection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _write(tmp_path, fleet(), request(allowed_regions=frozenset({"pre-cheap"})))
    assert main(args) == EXIT_REJECTED
    rejected = json.loads(capsys.readouterr().out)["rejected"]
    assert (rejected["reason"], rejected["error"]) == ("residency", "ResidencyUnsatisfiable")
    assert rejected["explanation"]["stages"][0]["cut"] == {"residency": ["dec-east", "dec-west"]}


def test_explain_names_the_bad_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _write(tmp_path, fleet(), request())
    document = json.loads((tmp_path / "snap.json").read_text())
    document["regions"][2]["num_gpus"] = 0
    (tmp_path / "snap.json").write_text(json.dumps(document))
    assert main(args) == EXIT_BAD_INPUT
    assert "snapshot.regions[2].num_gpus: Input should be greater than or equal to 1" in capsys.readouterr().err
    with pytest.raises(InvalidSchedulerInput) as info:
        explain_json(fleet().model_dump_json(), '{"tenant": "t"}')
    assert info.value.field == "request.prompt_tokens"


def test_explain_reports_an_unreadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--snapshot", str(tmp_path / "none.json"), "--request", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_explain_prints_schemas_and_the_default_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--schema", "snapshot"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"model", "regions", "links"} <= set(schema["properties"])
    assert main(["--default-policy"]) == 0
    assert capsys.readouterr().out == DEFAULT_POLICY_YAML


@pytest.mark.parametrize(
    "command", [["prfaas.cli.main", "sched", "explain"], ["prfaas.control_plane.scheduling.explain"]]
)
def test_prfaas_sched_explain_runs_as_a_command(tmp_path: Path, command: list[str]) -> None:
    def run(req: Request) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-m", *command, *_write(tmp_path, fleet(), req)]
        return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)

    placed = run(request(2_000))
    assert placed.returncode == 0, placed.stderr
    assert json.loads(placed.stdout)["mode"] == "local"
    rejected = run(request(allowed_regions=frozenset({"pre-cheap"})))
    assert rejected.returncode == EXIT_REJECTED
    assert json.loads(rejected.stdout)["rejected"]["reason"] == "residency"


@pytest.mark.parametrize("model", [ClusterSnapshot, ModelShape, Region, Link, Request, Slo])
def test_docs_describe_every_schema_field(model: type[Any]) -> None:
    missing = [name for name in model.model_fields if f"`{name}`" not in DOC]
    assert not missing, f"docs/scheduler.md lacks {model.__name__} fields {missing}"


@pytest.mark.parametrize("cls", [Decision, Cost, StageTrace])
def test_docs_describe_every_decision_field(cls: type[Any]) -> None:
    missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in DOC]
    assert not missing, f"docs/scheduler.md lacks {cls.__name__} fields {missing}"


@pytest.mark.parametrize(
    "spec", [PolicyConfig, DisaggregationSpec, TransferSpec, CodecSpec, ProfileSpec, FilterSpec, ScorerSpec]
)
def test_docs_describe_every_policy_key(spec: type[Any]) -> None:
    forms = ("`{}`", "`{}.", ".{}`", ".{}[")
    missing = [name for name in spec.model_fields if not any(form.format(name) in DOC for form in forms)]
    assert not missing, f"docs/scheduler.md lacks policy keys {missing}"


def test_docs_have_a_section_per_registered_plugin() -> None:
    registry = default_registry()
    kinds = {"filter": registry.filter_types(), "scorer": registry.scorer_types(), "picker": registry.picker_types()}
    for kind, types in kinds.items():
        for type_name in types:
            assert f"### `{type_name}` ({kind})" in DOC, f"no section for {kind} {type_name!r}"


def test_docs_show_the_default_policy_verbatim() -> None:
    body = DEFAULT_POLICY_YAML.split("\n", 1)[1]  # past the header comment
    assert body in DOC
