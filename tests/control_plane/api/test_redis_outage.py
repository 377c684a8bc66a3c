"""Redis SIGKILLed and restarted empty under a steady request rate (issue 29), on real processes: the API
(two processes), a Celery worker, a prefill and a decode region of tiny-llama, all on a `redis-server` of
this module's own, and the tenants in the SQLite database beside the ledger.

While Redis is away the API answers 503 with Retry-After (never 500, never a hang); once it is back empty,
the same API keys authenticate with no operator (the cache is filled from the database), every request sent
before the kill has ended with a completion or an error that gives its reason, the ledger bills only jobs
whose client got their answer, once each, and the tenant's concurrency is free again. A key revoked through
one API process is refused by the other within a second."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis
from cp_kit import openai_client, two_region_stack
from sqlalchemy import func, select

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.devstack.processes import api_argv, free_port
from prfaas.devstack.stack import ADMIN, Stack, http_ok, wait_until

pytestmark = pytest.mark.e2e
RATE_PER_S = 4.0
KILL_AT_S, RESTART_AT_S, LOAD_S = 3.0, 5.0, 10.0
TOKEN_DELAY_S = 0.1


class RedisServer:
    """A `redis-server` on `port`, no persistence: `kill()` loses everything, `start()` begins empty."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.folder)]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        wait_until(lambda: _pings(client), 10, 0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(5)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, RedisServer]]:
    folder = tmp_path_factory.mktemp("redis-outage")
    server = RedisServer(folder, free_port())
    server.start()
    try:
        env = {"PRFAAS_REDIS_URL": server.url, "PRFAAS_JOB_TIMEOUT_S": "30"}
        # tokens paced at 0.1 s: ~1 s a job, so that the kill finds some mid-stream
        for stack in two_region_stack(folder, env=env, decode_fields={"test_token_delay_s": TOKEN_DELAY_S}):
            yield stack, server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()


@dataclass
class Outcome:
    sent_at: float
    job_id: str = ""  # a completion's id: the job's
    status: int | None = None  # an error's HTTP status (None: in the stream, or no response)
    code: str | None = None  # an error's stable code (`store_unavailable`, `job_failed`)
    retry_after: str | None = None
    message: str = ""


def _ask(client: openai.OpenAI, i: int, sent_at: float) -> Outcome:
    prompt = f"request {i}: the quick brown fox jumps over the lazy dog " * 4
    try:
        if i % 2:
            reply = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8)
            return Outcome(sent_at, job_id=reply.id)
        finished, job_id = False, ""
        for chunk in client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, stream=True):
            job_id = chunk.id
            finished = finished or chunk.choices[0].finish_reason is not None
        return Outcome(sent_at, job_id=job_id) if finished else Outcome(sent_at, message="stream ended unfinished")
    except openai.APIStatusError as exc:
        retry_after = exc.response.headers.get("retry-after")
        return Outcome(sent_at, status=exc.status_code, code=exc.code, message=exc.message, retry_after=retry_after)
    except openai.APIError as exc:  # an error event in the stream, a dropped connection, a timeout
        return Outcome(sent_at, code=exc.code, message=f"{type(exc).__name__}: {exc.message}")


def test_redis_killed_and_restarted_empty_under_load(outage: tuple[Stack, RedisServer]) -> None:
    stack, server = outage
    tenant_id, key = stack.tenant("acme", rps=100, concurrency=64, budget_usd=1000)
    client = openai_client(stack, key, timeout_s=45)
    done = {client.completions.create(model="tiny-llama", prompt="warm up", max_tokens=2).id}

    start = time.monotonic()
    futures: list[Future[Outcome]] = []
    killed_at = restarted_at = 0.0
    with ThreadPoolExecutor(16) as pool:
        for i in range(int(LOAD_S * RATE_PER_S)):
            due = start + i / RATE_PER_S
            time.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic() - start
            if not killed_at and now >= KILL_AT_S:
                server.kill()
                killed_at = time.monotonic()
            if killed_at and not restarted_at and now >= RESTART_AT_S:
                server.start()  # empty
                restarted_at = time.monotonic()
            futures.append(pool.submit(_ask, client, i, time.monotonic()))
        outcomes = [f.result(timeout=90) for f in futures]  # every request ends: none hangs

    print(f"killed at {killed_at - start:.1f} s, restarted at {restarted_at - start:.1f} s")
    for o in outcomes:
        print(f"{o.sent_at - start:6.2f} s  {o.job_id or ''} {o.status or ''} {o.code or ''} {o.message[:120]}")
    assert not [o for o in outcomes if o.status is not None and o.status >= 500 and o.status != 503], outcomes
    assert all(o.job_id or o.code in ("store_unavailable", "job_failed") for o in outcomes)  # answer or reason
    assert all(o.retry_after == "2" for o in outcomes if o.code == "store_unavailable")
    cut = [o for o in outcomes if not o.job_id and o.sent_at < killed_at]  # in flight at the kill
    assert cut and all(o.code == "job_failed" and "job store unreachable mid-job" in o.message for o in cut), cut
    assert [o for o in outcomes if o.job_id and o.sent_at < killed_at]  # the load flowed before the kill
    assert not [o for o in outcomes if o.status == 401], "a key stopped authenticating"

    # Redis is back, empty: the same key works again with no operator (the regions re-register on their own).
    def answers() -> bool:
        try:
            done.add(client.completions.create(model="tiny-llama", prompt="after", max_tokens=2).id)
            return True
        except openai.APIStatusError as exc:
            if exc.status_code not in (503, 429):  # not 401: the key is known again
                raise
            return False

    wait_until(answers, 60, 0.5)

    done |= {o.job_id for o in outcomes if o.job_id}
    ledger = Ledger(stack.ledger_url, migrate=False)
    try:

        def billed() -> list[str]:
            with ledger.session() as s:
                return list(s.scalars(select(UsageEntry.job_id).where(UsageEntry.tenant == tenant_id)))

        time.sleep(1.0)  # the ledger writer's batch window
        rows = billed()
        with ledger.session() as s:
            answered_before = [o.job_id for o in outcomes if o.job_id and o.sent_at < killed_at]
            query = select(func.sum(UsageEntry.total_usd)).where(UsageEntry.job_id.in_(answered_before))
            spent_before_kill = float(s.scalar(query) or 0.0)
        assert len(rows) == len(set(rows))  # once each
        assert set(rows) <= done  # only jobs whose client got the answer
        print(f"{len(done)} answered, {len(rows)} billed")
    finally:
        ledger.close()

    def tenant() -> dict[str, object]:
        listed = httpx.get(stack.url + "/admin/tenants", headers=ADMIN, timeout=5).json()
        return next(t for t in listed if t["id"] == tenant_id)  # type: ignore[no-any-return]

    wait_until(lambda: tenant()["active_jobs"] == 0, 30, 0.2)  # the concurrency of jobs lost with Redis is free
    # the month's spend came back from the ledger with the tenant (a Redis restarted empty resets no budget)
    assert float(tenant()["spend_usd_this_month"]) >= spent_before_kill > 0  # type: ignore[arg-type]


def test_a_key_revoked_through_one_api_process_is_refused_by_another_within_a_second(
    outage: tuple[Stack, RedisServer],
) -> None:
    stack, _ = outage
    port = free_port()
    with (stack.folder / f"api-{port}.log").open("wb") as log:
        other = subprocess.Popen(api_argv("127.0.0.1", port), env=stack.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(url + "/readyz"), 60, 0.1)
        tenant_id, key = stack.tenant("revoked-soon")
        key_id = key.split("-")[1]
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(url + "/v1/models", headers=headers, timeout=5).status_code == 200  # cached there now
        revoked = httpx.delete(f"{stack.url}/admin/tenants/{tenant_id}/keys/{key_id}", headers=ADMIN, timeout=5)
        assert revoked.status_code == 200 and revoked.json()["revoked"] is True
        t0 = time.monotonic()
        stop = threading.Event()
        while not stop.is_set() and time.monotonic() - t0 < 5:
            if httpx.get(url + "/v1/models", headers=headers, timeout=5).status_code == 401:
                stop.set()
        refused_after = time.monotonic() - t0
        print(f"refused by the other API process {refused_after * 1000:.0f} ms after the revocation")
        assert stop.is_set() and refused_after < 1.0
    finally:
        other.kill()
        other.wait(10)
