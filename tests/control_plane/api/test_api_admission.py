"""Admission on a real API process (uvicorn, no worker), with the official `openai` client: a tenant over
its rate limit, its concurrency cap or its budget is refused before its prompt is tokenized (the API's
`prfaas_api_tokenize_seconds_count` does not move, and a multi-MB prompt is answered in milliseconds); a
request refused after tokenizing gives its concurrency slot back; the budget reserves each job's
predicted $ at admission, so concurrent jobs cannot take a tenant past its budget."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from cp_kit import api_stack, openai_client, stack_services

from prfaas.control_plane.services import Services
from prfaas.devstack.stack import ADMIN, Stack, wait_until
from prfaas.protos.prfaas.v1 import registry_pb2

pytestmark = pytest.mark.e2e
HUGE_PROMPT = "hello world " * 325_000  # 3.9 M characters, ~3.9 MB of JSON: under the 8 MiB body cap


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from api_stack(tmp_path_factory.mktemp("cp-admission"), PRFAAS_JOB_TIMEOUT_S="5")


@pytest.fixture(scope="module")
def services(stack: Stack) -> Iterator[Services]:
    yield from stack_services(stack)


def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai_client(stack, key, 60)


def tokenized(stack: Stack) -> float:
    """How many prompts the API process has tokenized (its metric)."""
    for line in httpx.get(stack.url + "/metrics", headers=ADMIN, timeout=5).text.splitlines():
        if line.startswith("prfaas_api_tokenize_seconds_count "):
            return float(line.split()[1])
    return 0.0


def huge(stack: Stack, key: str) -> tuple[float, openai.APIStatusError]:
    """(seconds, the error) of a completion of HUGE_PROMPT."""
    started = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as info:
        client(stack, key).completions.create(model="tiny-llama", prompt=HUGE_PROMPT, max_tokens=4)
    return time.perf_counter() - started, info.value


def test_a_huge_prompt_over_a_limit_is_refused_before_tokenizing(stack: Stack, services: Services) -> None:
    rated_id, rated = stack.tenant("rated", rps=5)
    now = int(time.time())
    for second in range(now, now + 60):  # the tenant already sent a million requests in each of these seconds
        services.redis.set(services.settings.key("tenant", rated_id, "rate", str(second)), 1_000_000, ex=90)
    _, busy = stack.tenant("busy", concurrency=1)
    _, broke = stack.tenant("broke", budget_usd=0)
    _, roomy = stack.tenant("roomy")
    huge(stack, roomy)  # warm-up: the first tokenizer call of the process is slower
    # the one slot, taken last: its job (no worker here) times out after PRFAAS_JOB_TIMEOUT_S, 5 s
    held = client(stack, busy).completions.create(model="tiny-llama", prompt="hi", stream=True)

    before = tokenized(stack)
    refusals = {}
    for name, key, status, code in (
        ("rate", rated, 429, "rate_limit_exceeded"),
        ("concurrency", busy, 429, "concurrency_limit_exceeded"),
        ("budget", broke, 402, "budget_exhausted"),
    ):
        refusals[name], error = huge(stack, key)
        assert (error.status_code, error.code) == (status, code), error.body
    assert tokenized(stack) == before  # none of the three reached the tokenizer
    admitted_s, error = huge(stack, roomy)  # admitted, tokenized, then too long for the model
    assert (error.status_code, error.code, tokenized(stack)) == (400, "context_length_exceeded", before + 1)
    print(
        "huge prompt: "
        + ", ".join(f"{name} refusal {s * 1000:.0f} ms" for name, s in refusals.items())
        + f"; admitted and tokenized {admitted_s * 1000:.0f} ms"
    )
    assert max(refusals.values()) < 0.5 * admitted_s
    held.close()


def test_a_request_refused_after_tokenizing_gives_its_slot_back(stack: Stack) -> None:
    _, key = stack.tenant("one-slot", concurrency=1)
    c = client(stack, key)
    with pytest.raises(openai.BadRequestError):  # admitted (the slot taken), tokenized, too long: slot given back
        c.completions.create(model="tiny-llama", prompt="hi " * 5000)
    stream = c.completions.create(model="tiny-llama", prompt="hi", stream=True)  # so the only slot is free
    with pytest.raises(openai.RateLimitError):
        c.completions.create(model="tiny-llama", prompt="hi")
    stream.close()


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Jobs that wait 60 s: each keeps its reservation through the burst however slow the host (with 5 s, a job
    of CI's loaded host timed out and gave its $ back mid-burst: a fourth was admitted)."""
    yield from api_stack(tmp_path_factory.mktemp("cp-budget"), PRFAAS_JOB_TIMEOUT_S="60")


@pytest.fixture(scope="module")
def roomy_services(roomy: Stack) -> Iterator[Services]:
    yield from stack_services(roomy)


def test_budget_reservations_keep_concurrent_jobs_within_the_budget(roomy: Stack, roomy_services: Services) -> None:
    """It registers a decode region (nothing listens at its address), so the scheduler predicts each job's $ (its
    local run there) and admission reserves it. Each stream is held open until the end: a stream dropped (its
    client gone) cancels its job, which gives its reservation back."""
    stack, services = roomy, roomy_services
    services.regions.register(
        registry_pb2.RegisterRequest(
            name="dec-x", role="decode", gpu_type="cpu", num_workers=1, usd_per_gpu_hour=4.0,
            grpc_endpoint="127.0.0.1:1", kv_endpoint="127.0.0.1:2", model="tiny-llama", kv_buffer_bytes=1 << 30,
            heartbeat_interval_s=60,
        )
    )  # fmt: skip
    time.sleep(0.5)  # the API's view of the fleet is at most 0.25 s old

    def tenant_view(tenant_id: str) -> dict[str, float]:
        tenants = httpx.get(stack.url + "/admin/tenants", headers=ADMIN, timeout=5).json()
        return next(t for t in tenants if t["id"] == tenant_id)  # type: ignore[no-any-return]

    def cancel(key: str, job_id: str) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        httpx.delete(f"{stack.url}/v1/jobs/{job_id}", headers=headers, timeout=5).raise_for_status()

    probe_id, probe = stack.tenant("probe")
    first = client(stack, probe).completions.create(model="tiny-llama", prompt="hi", max_tokens=16, stream=True)
    job_id = first.response.headers["x-prfaas-job-id"]
    predicted = float(services.jobs.get(job_id)["reserved_usd"])  # = the decision's cost of a local run
    assert predicted > 0 and tenant_view(probe_id)["reserved_usd"] == pytest.approx(predicted)
    cancel(probe, job_id)
    wait_until(lambda: tenant_view(probe_id)["reserved_usd"] == 0, 5, 0.05)  # canceled unbilled: released
    first.close()

    capped_id, capped = stack.tenant("capped", budget_usd=3.5 * predicted)  # 3 jobs fit, not 4

    held: list[Any] = []  # the open streams

    def submit(_: int) -> str:
        try:
            stream = client(stack, capped).completions.create(model="tiny-llama", prompt="hi", max_tokens=16,
                                                              stream=True)  # fmt: skip
        except openai.APIStatusError as exc:
            return f"{exc.status_code} {exc.code}"
        held.append(stream)
        return str(stream.response.headers["x-prfaas-job-id"])

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(submit, range(8)))
    jobs = [o for o in outcomes if not o.startswith("402")]
    assert len(jobs) == 3 and outcomes.count("402 budget_exhausted") == 5, outcomes
    view = tenant_view(capped_id)
    assert view["reserved_usd"] == pytest.approx(3 * predicted) and view["reserved_usd"] <= view["budget_usd"]
    for job in jobs:
        cancel(capped, job)
    wait_until(lambda: tenant_view(capped_id)["reserved_usd"] == 0, 5, 0.05)
    for stream in held:
        stream.close()
