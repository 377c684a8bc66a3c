"""The control plane as real processes with the official `openai` client: the API (uvicorn,
serving the region registry over gRPC), a Celery worker (Redis broker), one prefill and one
decode region (`prfaas region`, tiny-llama) registering through heartbeats; real Redis."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from cp_kit import stack_services, two_region_stack
from sqlalchemy import func, select

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.devstack.stack import ADMIN, RegionProcess, Stack, wait_until
from prfaas.engine.blocks import block_hashes, short
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.stops import output_text

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, list[RegionProcess]]]:
    for s in two_region_stack(tmp_path_factory.mktemp("cp-e2e")):
        yield s, s.regions


def _healthy(s: Stack) -> list[str]:
    return s.healthy()


@pytest.fixture(scope="module")
def tenant(stack: tuple[Stack, list[RegionProcess]]) -> tuple[str, str]:
    s, _ = stack
    return s.tenant("acme", allow_placement=True)


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine("tiny-llama")


def _client(s: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _job(s: Stack, key: str, job_id: str) -> dict[str, object]:
    job: dict[str, object] = httpx.get(f"{s.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}).json()
    return job


def test_long_prompt_splits_short_runs_local_both_equal_colocated(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str], engine: HFEngine, long_text: str
) -> None:
    s, _ = stack
    client = _client(s, tenant[1])
    long_ids = engine.encode(long_text)[:600]
    for prompt, mode, states in (
        (long_ids, "split", ["QUEUED", "PREFILLING", "TRANSFERRING", "DECODING", "DONE"]),
        ([5, 6, 7, 8], "local", ["QUEUED", "LOCAL", "DONE"]),
    ):
        reply = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8)
        colocated = engine.generate(prompt, SamplingParams(max_new_tokens=8))
        assert reply.choices[0].text == output_text(engine.decode_text, colocated)
        assert reply.usage is not None
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(colocated))
        job = _job(s, tenant[1], reply.id)
        assert job["placement_chosen"] == mode, job
        assert [e["state"] for e in job["timeline"]] == states  # type: ignore[attr-defined, union-attr]
        if mode == "split":
            assert job["bytes_raw"] == len(prompt) * engine.kv_bytes_per_token
            assert job["prefill_region"] == "prefill-a" and job["decode_region"] == "decode-b"
            _assert_the_link_was_measured(s, job["bytes_raw"])


def test_every_broker_key_is_under_the_deployment_prefix(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]
) -> None:
    """The Celery broker's keys (the queue, kombu's binding tables, its unacked hash) are under the deployment's
    key prefix, as every other key: deployments sharing a Redis stay apart and `prfaas down`, which deletes the
    prefix, leaves none. Before, `_kombu.binding.<prefix>:dispatch` and kombu's global `unacked` hash stayed."""
    s, _ = stack
    _client(s, tenant[1]).completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=2,
                                             extra_body={"prfaas": {"placement": "split"}})  # fmt: skip
    client = redis.Redis.from_url(s.env["PRFAAS_REDIS_URL"], decode_responses=True)
    try:
        ours = list(client.scan_iter(f"*{s.prefix}*", count=1000))
        assert f"{s.prefix}:_kombu.binding.dispatch" in ours, sorted(ours)
        assert [key for key in ours if not key.startswith(f"{s.prefix}:")] == []
    finally:
        client.close()


def _assert_the_link_was_measured(s: Stack, shipped: int) -> None:
    """The prefill region's heartbeats report what its KV sender saw on the path; /admin/links
    shows it beside the configured figures (within a window and a beat: a few seconds).

    Waits for a nonzero sending rate, not just an RTT: the channel can have an RTT from its handshake, so a
    beat can report one before the window holding the shipment's bytes closes. Once a beat reports those
    bytes the sender's smoothed rate only decays (by 1 - e^(-0.5 s / 5 s) a beat), never to 0."""
    deadline = time.monotonic() + 15
    while True:
        links = httpx.get(s.url + "/admin/links", headers=ADMIN, timeout=5).json()
        (link,) = [x for x in links if (x["src"], x["dst"]) == ("prefill-a", "decode-b")]
        measured = link["measured"]
        if measured is not None and measured["min_rtt_ms"] is not None and measured["sending_gbps"] > 0:
            break
        assert time.monotonic() < deadline, link
        time.sleep(0.25)
    assert 0 < measured["min_rtt_ms"] < 50 and measured["age_s"] < 15  # loopback
    assert link["scheduled"]["rtt_ms"] == measured["min_rtt_ms"]
    assert shipped > 0 and link["bandwidth_gbps"] > 0
    assert 0 < measured["sending_gbps"] < 1e3  # the shipment's bytes, at a rate loopback can carry (Gbit/s)


def test_a_conversations_next_turn_runs_where_its_prefix_is_cached(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str], engine: HFEngine, long_text: str
) -> None:
    """Turn 1 (long) splits; the decode region keeps its prompt's and reply's blocks and publishes them; the
    API hashes turn 2 the same way, so turn 2 runs locally there, computing only what is new, with the
    tokens of a cold run."""
    s, _ = stack
    client = _client(s, tenant[1])
    params = SamplingParams(max_new_tokens=8)
    first = engine.encode(long_text)[7000:7600]
    r1 = client.completions.create(model="tiny-llama", prompt=first, max_tokens=8)
    assert _job(s, tenant[1], r1.id)["placement_chosen"] == "split"
    reply = engine.generate(first, params)
    assert r1.choices[0].text == output_text(engine.decode_text, reply)
    hashes = [short(d) for d in block_hashes(first, 64, tenant[0])]  # scope `tenant`, 64-token blocks
    services = next(stack_services(s))
    recorded = services.jobs.get(r1.id)
    assert recorded["prefix"].split(",") == hashes and recorded["cache_salt"] == tenant[0]
    wait_until(lambda: set(hashes) <= services.regions.get("decode-b").prefix_blocks, 10, 0.1)
    services.close()

    turn2 = [*first, *reply, *engine.encode(long_text)[8000:8040]]
    r2 = client.completions.create(model="tiny-llama", prompt=turn2, max_tokens=8)

    job = _job(s, tenant[1], r2.id)
    assert job["placement_chosen"] == "local" and job["decode_region"] == "decode-b", job
    assert job["cached_tokens"] == ((len(first) + len(reply) - 1) // 64) * 64  # the reply's last token: not fed
    assert r2.choices[0].text == output_text(engine.decode_text, engine.generate(turn2, params))


def test_objectives_come_from_the_request_then_the_tenant_then_the_settings(
    stack: tuple[Stack, list[RegionProcess]],
) -> None:
    s, _ = stack
    _, key = s.tenant("objectives", ttft_slo_ms=1500, kv_codec="int8")
    client = _client(s, key)
    asked = client.completions.create(
        model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=2,
        extra_body={"prfaas": {"ttft_slo_ms": 900, "kv_codec": "lossless"}},
    )  # fmt: skip
    job = _job(s, key, asked.id)
    assert (job["ttft_slo_ms"], job["tpot_slo_ms"], job["kv_codec"]) == (900.0, 60_000.0, "lossless")
    default = client.completions.create(model="tiny-llama", prompt=[5, 6, 7, 9], max_tokens=2)
    job = _job(s, key, default.id)
    assert (job["ttft_slo_ms"], job["tpot_slo_ms"], job["kv_codec"]) == (1500.0, 60_000.0, "int8")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny-llama", prompt=[5], max_tokens=2, extra_body={"prfaas": {"kv_codec": "zfp"}}
        )
    assert info.value.code == "unknown_kv_codec" and info.value.param == "prfaas.kv_codec"
    listed = client.models.list().data[0].model_extra or {}  # what a tenant reads before consenting
    codecs = {c["name"]: c for c in listed["prfaas"]["kv_codecs"]}
    assert not codecs["lossless"].get("lossy") and codecs["kv8"]["lossy"] and 0 < codecs["kv8"]["token_agreement"] <= 1
    refused = httpx.post(s.url + "/admin/tenants", json={"name": "x", "kv_codec": "zfp"}, headers=ADMIN, timeout=5)
    assert refused.status_code == 400 and "kv_codec is neither lossless nor" in refused.json()["detail"]


def test_streaming_delivers_every_token_and_usage(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str], engine: HFEngine
) -> None:
    s, _ = stack
    client = _client(s, tenant[1])
    stream = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hello there"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    prompt = engine.encode("hello there", chat=True)
    colocated = engine.generate(prompt, SamplingParams(max_new_tokens=12))
    assert "".join(pieces) == output_text(engine.decode_text, colocated)
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(colocated))


def test_idempotency_key_returns_the_same_job(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]
) -> None:
    s, _ = stack
    client = _client(s, tenant[1])
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    first = client.completions.create(model="tiny-llama", prompt="once", max_tokens=4, extra_headers=headers)
    again = client.completions.create(model="tiny-llama", prompt="once", max_tokens=4, extra_headers=headers)
    assert again.id == first.id and again.choices[0].text == first.choices[0].text


def test_asked_placement_is_recorded(stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]) -> None:
    s, _ = stack
    client = _client(s, tenant[1])
    reply = client.completions.create(
        model="tiny-llama", prompt=[5, 6, 7, 8, 9], max_tokens=4, extra_body={"prfaas": {"placement": "split"}}
    )
    job = _job(s, tenant[1], reply.id)
    assert (job["placement_asked"], job["placement_chosen"]) == ("split", "split")


def test_local_jobs_are_placed_at_admission_without_celery(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str], engine: HFEngine
) -> None:
    s, _ = stack
    worker = s.workers.pop("w1")
    worker.terminate()
    worker.wait(30)
    try:  # no dispatcher runs: the API placed the short prompt and streamed it itself
        reply = _client(s, tenant[1]).completions.create(model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=4)
        assert reply.choices[0].text == output_text(
            engine.decode_text, engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=4))
        )
        job = _job(s, tenant[1], reply.id)
        assert job["placement_chosen"] == "local" and job["decode_region"] == "decode-b"
        assert [e["state"] for e in job["timeline"]] == ["QUEUED", "LOCAL", "DONE"]  # type: ignore[attr-defined, union-attr]
    finally:
        s.start_worker("w1")


def test_api_restart_keeps_job_state(stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]) -> None:
    s, _ = stack
    reply = _client(s, tenant[1]).completions.create(model="tiny-llama", prompt="survive", max_tokens=4)
    before = _job(s, tenant[1], reply.id)
    assert s.api is not None
    s.api.send_signal(signal.SIGKILL)
    s.api.wait(10)
    s.start_api()  # a new API process (it serves the registry again on the same port)
    assert _job(s, tenant[1], reply.id) == before
    assert before["state"] == "DONE"
    wait_until(lambda: len(_healthy(s)) == 2, 10, 0.1)  # the regions' heartbeats resume


def test_prefill_region_killed_fails_over_and_bills_once(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str], engine: HFEngine, long_text: str
) -> None:
    s, regions = stack
    prefill = regions[0]
    spent_before = _spend(s, tenant[0])
    prefill.proc.send_signal(signal.SIGKILL)  # the registry still counts it alive for 3 heartbeats
    prefill.proc.wait(5)
    prompt = engine.encode(long_text)[9000:9600]  # no region holds it: a split
    reply = _client(s, tenant[1]).completions.create(model="tiny-llama", prompt=prompt, max_tokens=6)
    assert reply.choices[0].text == output_text(
        engine.decode_text, engine.generate(prompt, SamplingParams(max_new_tokens=6))
    )
    job = _job(s, tenant[1], reply.id)
    states = [(e["state"], e["attempt"]) for e in job["timeline"]]  # type: ignore[attr-defined, union-attr]
    assert states[-1] == ("DONE", 2) and ("QUEUED", 2) in states, states
    assert job["placement_chosen"] == "local"
    assert sum(1 for state, _ in states if state == "DONE") == 1
    # Billed once, for attempt 2 (local in decode-b); attempt 1's prefill in the dead region is platform cost.
    ledger = Ledger(s.ledger_url, migrate=False)
    try:
        wait_until(lambda: ledger.entry(reply.id) is not None, 10, 0.05)
        entry = ledger.entry(reply.id)
        assert entry is not None and (entry.attempts, entry.placement) == (2, "local")
        assert entry.prefill_region == entry.decode_region == "decode-b"
        with ledger.session() as session:
            count = session.scalar(select(func.count()).select_from(UsageEntry).where(UsageEntry.job_id == reply.id))
        assert count == 1
        wasted = ledger.wasted(reply.id)
        assert [(w.attempt, w.phase, w.region) for w in wasted] == [(1, "prefill", "prefill-a")], wasted
        assert wasted[0].gpu_s > 0 and wasted[0].tenant == tenant[0]
        # the tenant's spend (what budgets are checked against) rises by the ledger entry, once
        wait_until(lambda: _spend(s, tenant[0]) - spent_before == pytest.approx(entry.total_usd), 10, 0.05)
        time.sleep(0.5)
        assert _spend(s, tenant[0]) - spent_before == pytest.approx(entry.total_usd)
    finally:
        ledger.close()


def _spend(s: Stack, tenant_id: str) -> float:
    tenants = httpx.get(s.url + "/admin/tenants", headers=ADMIN, timeout=5).json()
    return float(next(t["spend_usd_this_month"] for t in tenants if t["id"] == tenant_id))


def test_an_objective_no_placement_meets_fails_once_it_has_passed(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]
) -> None:
    """A TTFT objective of 5 ms that no region is predicted to meet: the job fails when the objective has
    passed (retrying a placement past it cannot meet it), not at the job's deadline (300 s here)."""
    s, _ = stack
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        _client(s, tenant[1]).completions.create(
            model="tiny-llama", prompt=[5, 6, 7, 8] * 200, max_tokens=2, extra_body={"prfaas": {"ttft_slo_ms": 5}}
        )
    assert time.monotonic() - started < 30
    assert info.value.status_code == 503 and "slo" in str(info.value.body), info.value.body


def test_every_choice_of_an_echo_with_logprobs_carries_the_prompts_logprobs(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]
) -> None:
    """As vLLM: `echo` with `logprobs` and n=2 gives each choice the prompt's logprobs (before, choices after the
    first had null for every prompt token), streamed and not."""
    s, _ = stack
    client = _client(s, tenant[1])
    asked = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 3, "echo": True, "logprobs": 1,
             "n": 2, "temperature": 0.8, "seed": 3}  # fmt: skip
    whole = client.completions.create(**asked)  # type: ignore[call-overload]
    by_choice = {c.index: c.logprobs.token_logprobs for c in whole.choices}
    streamed: dict[int, list[float | None]] = {0: [], 1: []}
    for chunk in client.completions.create(**asked, stream=True):  # type: ignore[call-overload]
        for c in chunk.choices:
            streamed[c.index] += c.logprobs.token_logprobs if c.logprobs else []
    for logprobs in (by_choice, streamed):
        prompt = [lp[: len(lp) - 3] for lp in (logprobs[0], logprobs[1])]  # the echoed prompt's tokens
        assert prompt[0] == prompt[1] and len(prompt[0]) > 1
        assert prompt[0][0] is None and all(v is not None for v in prompt[0][1:])


def test_max_tokens_past_what_the_context_leaves_is_shortened_as_vllm_does(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]
) -> None:
    """tiny-llama's context is 4096: a 4093-token prompt asked for 10 tokens gets 3 (`length`), and a chat
    without `max_tokens` gets what the context leaves, as vLLM (`get_max_tokens`). Before, the first was 400
    `context_length_exceeded` and a chat without `max_tokens` stopped at 16 tokens."""
    s, _ = stack
    client = _client(s, tenant[1])
    ignore = {"ignore_eos": True}
    reply = client.completions.create(model="tiny-llama", prompt=[5] * 4093, max_tokens=10, extra_body=ignore)
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (3, "length"), reply  # type: ignore[union-attr]
    auth = {"Authorization": f"Bearer {tenant[1]}"}
    messages = [{"role": "user", "content": "hi " * 2030}]  # 2 tokens each
    counted = httpx.post(f"{s.url}/tokenize", json={"model": "tiny-llama", "messages": messages}, headers=auth,
                         timeout=30).json()["count"]  # fmt: skip
    assert 4050 < counted < 4096 - 16, counted  # room for fewer tokens than the old default of 16
    chat = client.chat.completions.create(model="tiny-llama", messages=messages, extra_body=ignore)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.completion_tokens == 4096 - counted, chat.usage
    assert chat.choices[0].finish_reason == "length"


def test_a_streamed_chat_sends_a_role_chunk_per_choice(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]
) -> None:
    """As vLLM: a streamed chat with n=2 opens with one chunk per choice, each with that choice's role (before,
    one chunk held both, and a client reading `choices[0]` lost the second's), then each choice's content."""
    s, _ = stack
    chunks = list(_client(s, tenant[1]).chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2, temperature=0.8,
        seed=3, stream=True,
    ))  # fmt: skip
    opening = [[(c.index, c.delta.role, c.delta.content) for c in chunk.choices] for chunk in chunks[:2]]
    assert opening == [[(0, "assistant", "")], [(1, "assistant", "")]], opening
    assert all(len(chunk.choices) == 1 and chunk.choices[0].delta.role is None for chunk in chunks[2:])
    assert {chunk.choices[0].index for chunk in chunks[2:]} == {0, 1}


def test_echo_with_max_tokens_0_scores_the_prompt(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]
) -> None:
    """As vLLM (tests/e2e/test_openai_parity.py compares the two): `echo` with `max_tokens` 0 answers the prompt
    alone, with its logprobs when asked; the one token generated counts in usage, not in the text. Without echo,
    max_tokens 0 is refused."""
    s, _ = stack
    client = _client(s, tenant[1])
    asked = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 0, "echo": True, "logprobs": 1}
    reply = client.completions.create(**asked)  # type: ignore[call-overload]
    [choice] = reply.choices
    assert choice.text == "Once upon a time" and choice.finish_reason in ("length", "stop")
    assert reply.usage is not None and reply.usage.completion_tokens == 1
    assert "".join(choice.logprobs.tokens) == "Once upon a time"  # the prompt's tokens, not the generated one
    assert (
        choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == reply.usage.prompt_tokens
    )
    chunks = list(client.completions.create(**asked, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Once upon a time"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=0)


def test_chat_template_controls_as_vllm_takes_them(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]
) -> None:
    """vLLM's chat fields: `continue_final_message` continues the last assistant message (a prefill: the prompt
    ends in its text, not in a closed turn), `add_generation_prompt: false` leaves the assistant turn unopened,
    and the defaults of OpenAI's `response_format` (text) and `tool_choice` ("none") change nothing (before, each
    was 400 unsupported_parameter)."""
    s, _ = stack
    auth = {"Authorization": f"Bearer {tenant[1]}"}
    user, prefill = {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}

    def ask(fields: dict[str, Any]) -> dict[str, Any]:
        body = {"model": "tiny-llama", "max_tokens": 3, "temperature": 0.0} | fields
        reply = httpx.post(f"{s.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert reply.status_code == 200, reply.text
        return dict(reply.json())

    plain = ask({"messages": [user]})
    defaults = ask({"messages": [user], "response_format": {"type": "text"}, "tool_choice": "none",
                    "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert defaults["choices"][0]["message"] == plain["choices"][0]["message"]
    continued = ask({"messages": [user, prefill], "continue_final_message": True, "add_generation_prompt": False})
    closed = ask({"messages": [user, prefill]})
    counted = {
        name: httpx.post(f"{s.url}/tokenize", headers=auth, timeout=10, json={"model": "tiny-llama",
                         "messages": [user, prefill], "add_generation_prompt": agp}).json()["count"]
        for name, agp in (("closed", True), ("unopened", False))
    }  # fmt: skip
    assert closed["usage"]["prompt_tokens"] == counted["closed"]
    # continued: no <|im_end|> and newline after the prefill, no assistant turn opened
    assert continued["usage"]["prompt_tokens"] < counted["unopened"] < counted["closed"]


def test_a_stream_sends_a_chunk_per_token_even_when_its_text_is_held_back(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str]
) -> None:
    """As vLLM streams: one chunk per token, with text "" while a stop string's possible start is held back (here
    7 characters of an 8-character stop string that never comes), so a client counting chunks (`vllm bench`'s
    inter-token latency) counts tokens. Before, a token with no new text sent no chunk: 12 tokens came in fewer."""
    s, _ = stack
    fields = {"model": "tiny-llama", "prompt": "once upon a time", "max_tokens": 12, "stop": ["zzzzzzzz"],
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    client = _client(s, tenant[1])
    whole = client.completions.create(**fields)  # type: ignore[call-overload]
    chunks = [c for c in client.completions.create(**fields, stream=True) if c.choices]  # type: ignore[call-overload]
    assert len(chunks) == whole.usage.completion_tokens == 12, [c.choices[0].text for c in chunks]
    assert any(c.choices[0].text == "" for c in chunks[:-1])  # held back, sent as an empty chunk
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


@pytest.mark.parametrize("model", [None, "", "omitted"])
def test_a_request_without_a_model_gets_the_served_one_and_null_usage_options_are_taken(
    stack: tuple[Stack, list[RegionProcess]], tenant: tuple[str, str], model: str | None
) -> None:
    """As vLLM: `model` omitted, null or "" is the served model (before: 400), and `stream_options` fields may
    be null (before: 400); a model named and not served is still 404."""
    s, _ = stack
    body: dict[str, Any] = {"prompt": "hi", "max_tokens": 2, "stream": True,
                            "stream_options": {"include_usage": None, "continuous_usage_stats": None}}  # fmt: skip
    if model != "omitted":
        body["model"] = model
    auth = {"Authorization": f"Bearer {tenant[1]}"}
    reply = httpx.post(s.url + "/v1/completions", json=body, headers=auth, timeout=60)
    assert reply.status_code == 200, reply.text
    assert '"model": "tiny-llama"' in reply.text and reply.text.rstrip().endswith("data: [DONE]")
    assert '"usage"' not in reply.text  # include_usage null: not asked
    other = httpx.post(s.url + "/v1/completions", json=body | {"model": "gpt-4"}, headers=auth, timeout=60)
    assert (other.status_code, other.json()["error"]["code"]) == (404, "model_not_found")
