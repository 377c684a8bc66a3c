"""The package map of docs/ARCHITECTURE.md, checked from the source: which package may import
which (arrows point one way), no cycles, nothing imports the benchmarks, no product module
past 400 lines, and every package in the wheel. Read with `ast`: nothing is imported."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400

# package -> the packages of ours it may import. Anything else is a wrong arrow.
ALLOWED: dict[str, set[str]] = {
    "protos": set(),
    "transport": set(),
    "telemetry": set(),  # tracing, used by every process
    "engine": {"transport"},  # the vLLM connector ships KV over prfaas's transport
    "region": {"engine", "transport", "protos", "telemetry"},
    "prefill_region": {"region", "engine", "transport", "protos", "telemetry"},
    "decode_region": {"region", "engine", "transport", "protos", "telemetry"},
    "control_plane": {"transport", "protos", "engine", "region", "telemetry"},  # region: see NARROW
    "sim": {"control_plane"},
    "loadgen": {"engine"},  # the model's tokenizer for real prompts
    # region configs; the default policy file; the demo; the deployment's certificates
    "devstack": {"region", "control_plane", "engine", "transport", "telemetry"},
    "cli": {"engine", "transport", "protos", "region", "prefill_region", "decode_region", "control_plane", "sim"}
    | {"loadgen", "devstack", "telemetry"},
    "bench": {"engine", "transport", "protos", "region", "control_plane", "sim", "loadgen", "devstack"},
}
# Arrows allowed to some modules of a package only: (importer, imported) -> those modules.
NARROW: dict[tuple[str, str], set[str]] = {
    # gRPC plumbing both ends of a region's calls use (channels, TLS, authorization; the sampling specification
    # and logprobs as the wire carries them, converted the same way at both ends), not the host itself
    ("control_plane", "region"): {"prfaas.region.channels", "prfaas.region.authz", "prfaas.region.requests"},
    ("sim", "control_plane"): {"prfaas.control_plane.scheduling"},  # the very policies the control plane runs
}
PACKAGES = sorted(ALLOWED)


def _modules(package: str) -> Iterator[Path]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if "_pb2" not in path.name:  # generated stubs
            yield path


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every `prfaas.*` module `path` imports, at any depth of the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("prfaas."):
                yield node.lineno, name


def _package_of(module: str) -> str:
    return module.split(".")[1]


def _edges(importers: list[str]) -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> where, "file:line module"."""
    edges: dict[tuple[str, str], list[str]] = {}
    for package in importers:
        for path in _modules(package):
            for line, module in _imports(path):
                target = _package_of(module)
                if target != package:
                    edges.setdefault((package, target), []).append(f"{path.relative_to(ROOT)}:{line} {module}")
    return edges


def test_every_arrow_between_packages_is_one_the_map_allows() -> None:
    wrong = {
        f"{a} -> {b}": where[:3]
        for (a, b), where in _edges(PACKAGES).items()
        if b not in ALLOWED[a] and b in ALLOWED  # a module of another distribution (prfaas.protos.prfaas ok)
    }
    assert wrong == {}


def test_narrow_arrows_reach_only_their_modules() -> None:
    edges = _edges(PACKAGES)
    wrong = []
    for (a, b), modules in NARROW.items():
        for where in edges.get((a, b), []):
            module = where.split()[-1]
            if not any(module == m or module.startswith(m + ".") for m in modules):
                wrong.append(where)
    assert wrong == []


def test_protos_and_transport_import_nothing_of_ours() -> None:
    edges = _edges(["protos", "transport"])
    assert {k: v for k, v in edges.items() if k[1] in ALLOWED} == {}


def test_the_two_roles_never_import_each_other() -> None:
    edges = _edges(["prefill_region", "decode_region"])
    assert ("prefill_region", "decode_region") not in edges
    assert ("decode_region", "prefill_region") not in edges


def test_the_package_graph_has_no_cycle() -> None:
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for a, b in _edges(PACKAGES):
        if b in graph:
            graph[a].add(b)
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = "done"
        return None

    cycles = [c for p in PACKAGES if p not in state and (c := visit(p, []))]
    assert cycles == []


def test_nothing_imports_the_benchmarks_not_even_the_tests() -> None:
    users = {a: where for (a, b), where in _edges([*PACKAGES, "tests"]).items() if b == "bench" and a != "bench"}
    assert users == {}


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "bench"])  # bench: scripts, not product
def test_no_product_module_is_over_400_lines(package: str) -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules(package)}
    long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert long == {}


def test_every_package_folder_is_in_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {
        "prfaas." + ".".join(init.parent.relative_to(ROOT).parts)
        for package in PACKAGES
        for init in (ROOT / package).rglob("__init__.py")
    }
    assert folders - listed == set()
    assert {name.split(".")[1] for name in listed} <= set(PACKAGES)
    assert set(config["package-dir"]) == {f"prfaas.{p}" for p in PACKAGES}
