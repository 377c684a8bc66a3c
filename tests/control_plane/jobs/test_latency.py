"""Where a finished job's time went: `stage_seconds` on split, local and retried timelines, the bounded
tenant label, and, on real processes (metering_kit's stack), every histogram docs/operations.md names
exported with observations, once per billed job."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from metering_kit import Metered

from prfaas.control_plane.jobs.latency import BoundedLabel, stage_seconds
from prfaas.devstack.stack import ADMIN

DOCS = Path(__file__).resolve().parents[3] / "docs" / "operations.md"


def _timeline(*moves: tuple[str, int, float]) -> list[dict[str, object]]:
    return [{"state": state, "attempt": attempt, "at": at} for state, attempt, at in moves]


def test_a_split_jobs_stages() -> None:
    job = {"attempt": "1", "created_at": "100.0", "first_token_at": "103.5", "placement_s": "0.002",
           "reserve_s": "0.010"}  # fmt: skip
    timeline = _timeline(("QUEUED", 1, 100.0), ("PREFILLING", 1, 100.25), ("TRANSFERRING", 1, 103.0),
                         ("DECODING", 1, 103.5), ("DONE", 1, 105.0))  # fmt: skip
    assert stage_seconds(job, timeline, tpot_s=0.05) == pytest.approx({
        "queue": 0.25, "placement": 0.002, "reserve": 0.010, "prefill": 2.75, "transfer": 0.5, "first_token": 3.5,
        "tpot": 0.05, "e2e": 5.0,
    })  # fmt: skip


def test_a_local_jobs_prefill_runs_to_its_first_token_and_it_has_no_transfer() -> None:
    job = {"attempt": "1", "created_at": "10.0", "first_token_at": "10.4"}
    stages = stage_seconds(job, _timeline(("QUEUED", 1, 10.0), ("LOCAL", 1, 10.0), ("DONE", 1, 11.0)))
    assert stages == pytest.approx({"queue": 0.0, "prefill": 0.4, "first_token": 0.4, "e2e": 1.0})


def test_a_retried_job_counts_the_attempt_that_answered() -> None:
    job = {"attempt": "2", "created_at": "0.0", "first_token_at": "9.0"}
    timeline = _timeline(("QUEUED", 1, 0.0), ("PREFILLING", 1, 0.1), ("QUEUED", 2, 5.0), ("PREFILLING", 2, 5.5),
                         ("TRANSFERRING", 2, 8.0), ("DECODING", 2, 9.0), ("DONE", 2, 10.0))  # fmt: skip
    stages = stage_seconds(job, timeline)
    assert (stages["queue"], stages["prefill"], stages["e2e"]) == pytest.approx((0.5, 2.5, 10.0))
    assert stages["first_token"] == 9.0  # the client waited for both attempts


def test_the_tenant_label_keeps_its_first_values_and_folds_the_rest() -> None:
    label = BoundedLabel(2)
    assert [label(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", "other", "a", "other", "b"]


def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def _documented() -> dict[str, str]:
    """histogram -> process, from the table of docs/operations.md's "Metrics" section."""
    section = DOCS.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(prfaas_\w+)` \| (api|region) \|", section, re.M))


@pytest.mark.e2e
def test_every_documented_histogram_is_exported_with_observations(metered: Metered) -> None:
    documented = _documented()
    assert len(documented) >= 12 and "prfaas_job_first_token_seconds" in documented
    api = _samples(httpx.get(metered.stack.url + "/metrics", headers=ADMIN, timeout=5).text)
    regions = [_samples(httpx.get(f"http://{r.metrics}/metrics", timeout=5).text) for r in metered.stack.regions]
    for name, process in documented.items():
        exported = [api] if process == "api" else regions
        counts = [v for s in exported for k, v in s.items() if k.startswith(f"{name}_count")]
        assert counts, f"{name}: exported by no {process} process"
        if name != "prfaas_api_tokenize_seconds":  # these prompts are token ids: nothing to tokenize
            assert sum(counts) > 0, f"{name}: never observed"
    # once per billed DONE job (not one its client cut short), by the API process that billed it (the stack has one)
    billed = sum(v for k, v in api.items() if k.startswith("prfaas_billed_jobs_total"))
    cut = {k.split("{")[1]: v for k, v in api.items() if k.startswith("prfaas_billed_cut_jobs_total{")}
    e2e = sum(v for k, v in api.items() if k.startswith("prfaas_job_e2e_seconds_count"))
    assert e2e == billed - sum(cut.values()) > 0
    split = sum(v for k, v in api.items() if k.startswith("prfaas_job_transfer_seconds_count{"))
    assert split == api['prfaas_billed_jobs_total{placement="split"}'] - cut.get('placement="split"}', 0)
    assert api['prfaas_link_kv_bytes_total{kind="raw",link="prefill-a>decode-b"}'] > 0
    tenants = {m.group(1) for k in api for m in [re.search(r'tenant="([^"]+)"', k)] if m}
    assert set(metered.ids.values()) <= tenants  # by tenant (bounded: 50 per process)


@pytest.mark.e2e
def test_every_grafana_query_names_a_series_the_services_export(metered: Metered) -> None:
    """docs/grafana/prfaas.json: each metric its queries (and its tenant variable) read is a sample name
    the API or a region exports."""
    import json

    dashboard = json.loads((DOCS.parent / "grafana" / "prfaas.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    named = {m for q in queries for m in re.findall(r"\bprfaas_[a-z0-9_]+", q)}
    assert len(queries) >= 20 and len(named) >= 20
    texts = [httpx.get(metered.stack.url + "/metrics", headers=ADMIN, timeout=5).text]
    texts += [httpx.get(f"http://{r.metrics}/metrics", timeout=5).text for r in metered.stack.regions]
    exported = {name.split("{")[0] for text in texts for name in _samples(text)}
    suffixes = {"counter": ("", "_total"), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    for text in texts:  # a labelled family with no sample yet (no refusal so far) is still exported
        for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
            exported |= {family + suffix for suffix in suffixes.get(kind, ("",))}
    assert sorted(named - exported) == []
