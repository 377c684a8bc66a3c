"""Every parameter of OpenAI's completions and chat schemas, as the `openai` package itself types
them, is either honoured (a field of our request schema) or refused with 400
`unsupported_parameter` naming it: never ignored. Also the refusals that need the model (token ids
out of its vocabulary), and vLLM's server extras (/health, /version, /tokenize, /detokenize).
The API process alone (no worker, no region): every request here ends before admission."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from cp_kit import api_stack, openai_client
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import ValidationError

from prfaas.control_plane.api.openai_schemas import (
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    ChatCompletionCreate,
    CompletionCreate,
)
from prfaas.devstack.stack import ADMIN, Stack

pytestmark = pytest.mark.e2e
MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from api_stack(tmp_path_factory.mktemp("cp-params"), PRFAAS_JOB_TIMEOUT_S="3")


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.tenant("params")[1]


def _openai_params(typed: type) -> set[str]:
    names: set[str] = set()
    for klass in typed.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    return names


@pytest.mark.parametrize(
    ("typed", "schema", "refused"),
    [
        (completion_create_params.CompletionCreateParamsBase, CompletionCreate, REFUSED_COMPLETION),
        (chat_create_params.CompletionCreateParamsBase, ChatCompletionCreate, REFUSED_CHAT),
    ],
    ids=["completions", "chat"],
)
def test_every_openai_parameter_is_honoured_or_refused(typed: type, schema: Any, refused: tuple[str, ...]) -> None:
    params = _openai_params(typed) | {"stream"}
    unknown = params - set(schema.model_fields)
    assert not unknown, f"OpenAI parameters our schema neither honours nor refuses: {sorted(unknown)}"
    for name in refused:  # declared to take null only, so a value is refused (api/errors.py)
        assert schema.model_fields[name].annotation is type(None), name


@pytest.mark.parametrize("name", REFUSED_COMPLETION)
def test_refused_completion_parameters_get_400_naming_them(stack: Stack, key: str, name: str) -> None:
    client = openai_client(stack, key, 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={name: 2})
    assert (info.value.code, info.value.param) == ("unsupported_parameter", name)
    assert name in info.value.message


@pytest.mark.parametrize("name", REFUSED_CHAT)
def test_refused_chat_parameters_get_400_naming_them(stack: Stack, key: str, name: str) -> None:
    client = openai_client(stack, key, 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,  # type: ignore[arg-type]
                                       extra_body={name: {"type": "something"}})  # fmt: skip
    assert (info.value.code, info.value.param) == ("unsupported_parameter", name)


def test_null_refused_parameters_and_unknown_ones(stack: Stack, key: str) -> None:
    client = openai_client(stack, key, 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"temprature": 0.5})
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "temprature")  # a typo is no no-op


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"n": 17}, "n", "invalid_request"),
        ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids", "invalid_request"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "invalid_request"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "invalid_request"),
        ({"logprobs": 21}, "logprobs", "invalid_request"),
        ({"top_p": 0}, "top_p", "invalid_request"),
        ({"extra_body": {"min_tokens": 5}}, "min_tokens", "invalid_request"),  # more than max_tokens
        ({"stop": [""]}, "stop.0", "invalid_request"),  # the list's item (before: "a valid string", `stop`)
    ],
)
def test_out_of_range_sampling_gets_400_naming_it(
    stack: Stack, key: str, fields: dict[str, Any], param: str, code: str
) -> None:
    client = openai_client(stack, key, 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **fields)
    assert (info.value.code, info.value.param) == (code, param), info.value.message


def test_max_completion_tokens_is_named_as_asked_and_the_operators_cap_said(tmp_path: Any) -> None:
    """A chat's `max_completion_tokens` over the context is named as such (before: `max_tokens`); the operator's
    cap (`max_new_tokens_limit`, here under the context) says so."""
    for s in api_stack(tmp_path, PRFAAS_MAX_NEW_TOKENS_LIMIT="100"):
        auth = {"Authorization": f"Bearer {s.tenant('capped')[1]}"}
        cases = (
            ("max_completion_tokens", 5000, "is more than the model's context (4096 tokens)"),
            ("max_tokens", 101, "is more than this deployment allows (100, max_new_tokens_limit)"),
        )
        for field, asked, message in cases:
            body = {"model": MODEL, "messages": CHAT, field: asked}
            error = httpx.post(f"{s.url}/v1/chat/completions", json=body, headers=auth, timeout=10).json()["error"]
            assert (error["param"], error["code"]) == (field, "invalid_request"), error
            assert error["message"] == f"invalid request: {field}: {asked} {message}", error


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        # the telling member of a union: before, "Input should be a valid string" for each
        # OpenAI's and vLLM's 4 (VLLM_MAX_STOP_STRINGS); before, 16 were taken
        ({"prompt": "hi", "stop": [str(i) for i in range(5)]}, "stop", "List should have at most 4 items"),
        ({"prompt": [f"p{i}" for i in range(65)]}, "prompt", "List should have at most 64 items"),
        ({"prompt": [1, -2]}, "prompt.1", "greater than or equal to 0"),
        ({"prompt": ["a", 5]}, "prompt", "Input should be a valid string"),  # not "prompt.0: a valid integer"
        # more than the model's context, whatever the prompt (before: `prompt too long for the model`), as vLLM
        ({"prompt": "hi", "max_tokens": 5000}, "max_tokens", "max_tokens: 5000 is more than the model's context (4096"),
        # greedy by default here (OpenAI's default samples): the refusal says what to set
        ({"prompt": "hi", "n": 2}, "n", "this deployment's default temperature is 0: set temperature for n > 1"),
    ],
)
def test_a_refusal_says_what_is_wrong(stack: Stack, key: str, body: dict[str, Any], param: str, message: str) -> None:
    reply = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, "max_tokens": 2} | body,
                       headers={"Authorization": f"Bearer {key}"}, timeout=10)  # fmt: skip
    error = reply.json()["error"]
    assert (reply.status_code, error["code"], error["param"]) == (400, "invalid_request", param), error
    assert message in error["message"], error


@pytest.mark.parametrize(
    "raw",
    [b'{"model": "tiny-llama", "prompt": "\xff"}', b'{"a": ' + b"[" * 100_000],
    ids=["bad-utf8", "too-deep"],
)
def test_a_body_that_cannot_be_parsed_is_an_invalid_request(stack: Stack, key: str, raw: bytes) -> None:
    """FastAPI's own 400 had code null; the documented shape is `invalid_request`, `invalid request: body: ...`."""
    reply = httpx.post(f"{stack.url}/v1/completions", content=raw, timeout=10,
                       headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})  # fmt: skip
    error = reply.json()["error"]
    assert (reply.status_code, error["code"]) == (400, "invalid_request"), error
    assert error["message"].startswith("invalid request: body: "), error


def test_a_batch_the_tenants_limits_never_admit_whole_is_400_not_a_retried_429(stack: Stack) -> None:
    _, key = stack.tenant("small", concurrency=2, rps=10)
    client = openai_client(stack, key, 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2)
    assert (info.value.code, info.value.param) == ("batch_too_large", "prompt")
    assert "3 prompts, and this tenant's limits (concurrency 2, 10 requests/s) admit at most 2 at once" in str(
        info.value.message
    )


def test_a_batch_sent_again_with_its_idempotency_key_attaches_whatever_the_limits_now(stack: Stack) -> None:
    """Its jobs were admitted: the retry attaches to them, admits none, so the limits (lowered since) do not apply."""
    tenant, key = stack.tenant("again", concurrency=3, rps=10)
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "batch-1"}
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2}
    first = httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=30)  # no region: fails
    assert first.status_code >= 500, first.text
    lowered = httpx.patch(f"{stack.url}/admin/tenants/{tenant}", json={"concurrency": 2}, headers=ADMIN, timeout=5)
    assert lowered.status_code == 200, lowered.text
    again = httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert again.status_code != 400 and again.json()["error"]["code"] != "batch_too_large", again.text  # attached


def test_an_unknown_capitalised_parameter_is_named(stack: Stack, key: str) -> None:
    reply = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "Temperature": 0.5},
                       headers={"Authorization": f"Bearer {key}"}, timeout=10)  # fmt: skip
    error = reply.json()["error"]
    assert (reply.status_code, error["code"], error["param"]) == (400, "unsupported_parameter", "Temperature"), error


def test_tokenize_names_the_field_not_the_schema(stack: Stack, key: str) -> None:
    reply = httpx.post(f"{stack.url}/tokenize", json={"prompt": 5}, headers={"Authorization": f"Bearer {key}"},
                       timeout=5)  # fmt: skip
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text


def test_top_logprobs_needs_logprobs(stack: Stack, key: str) -> None:
    client = openai_client(stack, key, 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, top_logprobs=2)  # type: ignore[arg-type]
    assert info.value.param == "top_logprobs"


def test_vllm_server_extras(stack: Stack, key: str) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.get(stack.url + "/health", timeout=5).status_code == 200
    assert httpx.get(stack.url + "/version", timeout=5).json()["version"]
    tokens = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "prompt": "hello world"}, headers=auth,
                        timeout=5).json()  # fmt: skip
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    text = httpx.post(stack.url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, headers=auth,
                      timeout=5).json()  # fmt: skip
    assert text["prompt"] == "hello world"
    chat = httpx.post(stack.url + "/tokenize", json={"messages": CHAT}, headers=auth, timeout=5).json()
    assert chat["count"] > tokens["count"] - 2  # the chat template's tokens around the message
    unnamed = httpx.post(stack.url + "/tokenize", json={"model": "", "prompt": "hello world"}, headers=auth, timeout=5)
    assert unnamed.json()["tokens"] == tokens["tokens"]  # "": the served model, as the generation routes take it
    denied = httpx.post(stack.url + "/tokenize", json={"prompt": "hi"}, timeout=5)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "missing_api_key"
    bad = httpx.post(stack.url + "/detokenize", json={"tokens": [10**9]}, headers=auth, timeout=5)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_stream_options_need_a_stream_unless_empty_as_vllm() -> None:
    """vLLM refuses `stream_options` without `stream=true` when it sets anything (`{}` passes its check)."""
    CompletionCreate(model="m", prompt="x", stream_options={})  # type: ignore[arg-type]
    CompletionCreate(model="m", prompt="x", stream=True, stream_options={"include_usage": True})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="Stream options can only be defined when `stream=True`"):
        CompletionCreate(model="m", prompt="x", stream_options={"include_usage": False})  # type: ignore[arg-type]


def test_a_chat_without_max_tokens_is_not_refused_where_the_cap_passes_the_context(tmp_path: Any) -> None:
    """`max_new_tokens_limit` 5000 over tiny-llama's 4096 context: a chat without `max_tokens` is admitted (its
    default is what the context leaves), not refused for a `max_tokens` it never sent."""
    for s in api_stack(tmp_path, PRFAAS_MAX_NEW_TOKENS_LIMIT="5000", PRFAAS_JOB_TIMEOUT_S="1"):
        auth = {"Authorization": f"Bearer {s.tenant('uncapped')[1]}"}
        reply = httpx.post(f"{s.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT}, headers=auth,
                           timeout=30)  # fmt: skip
        assert reply.status_code != 400, reply.text  # no region here: the job times out after 1 s
        job = httpx.get(f"{s.url}/v1/jobs/{reply.headers['X-Prfaas-Job-Id']}", headers=auth, timeout=5).json()
        assert job["state"] in ("FAILED", "CANCELED"), job  # admitted, run, timed out


def test_a_failed_answer_names_its_job(stack: Stack, key: str) -> None:
    """A `stream=false` request whose job fails (here: no region, and a 3 s job deadline) carries the job's id in
    `X-Prfaas-Job-Id`, as a stream does, so its timeline can be looked up (before, the error had no header)."""
    auth = {"Authorization": f"Bearer {key}"}
    reply = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers=auth, timeout=30)  # fmt: skip
    assert reply.status_code >= 500 and reply.json()["error"]["code"], reply.text
    job = httpx.get(f"{stack.url}/v1/jobs/{reply.headers['X-Prfaas-Job-Id']}", headers=auth, timeout=5).json()
    assert job["state"] in ("FAILED", "CANCELED"), job


def _tokenized(stack: Stack, key: str, messages: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(f"{stack.url}/tokenize", json={"model": MODEL, "messages": messages},
                      headers={"Authorization": f"Bearer {key}"}, timeout=10)  # fmt: skip


def test_developer_messages_are_system_ones_for_a_template_without_that_role(stack: Stack, key: str) -> None:
    """As vLLM renders them (renderers/hf.py): tiny-llama's template knows no `developer` role, so those messages
    are `system` ones, merged with the others into one, first (before, `<|im_start|>developer` went to a model
    that never saw it, behind the default system prompt of templates that add one)."""
    user = {"role": "user", "content": "hi"}
    pairs = [
        ([{"role": "developer", "content": "Be brief"}, user], [{"role": "system", "content": "Be brief"}, user]),
        ([{"role": "system", "content": "A"}, {"role": "developer", "content": "B"}, user],
         [{"role": "system", "content": "A\n\nB"}, user]),
        ([user, {"role": "developer", "content": "B"}], [{"role": "system", "content": "B"}, user]),
    ]  # fmt: skip
    for asked, rendered in pairs:
        assert _tokenized(stack, key, asked).json()["tokens"] == _tokenized(stack, key, rendered).json()["tokens"]


def test_an_assistant_message_as_the_sdk_returns_it_is_taken(stack: Stack, key: str) -> None:
    """`choices[0].message.model_dump()` sent back in the next turn (its null refusal, tool_calls, function_call,
    audio, annotations), null content, an empty tool_calls list, Responses-style text parts and a part's
    cache_control: taken as vLLM takes them (before, each was 400); a tool call made is still refused."""
    user = {"role": "user", "content": "hi"}
    plain = [user, {"role": "assistant", "content": "yo"}, user]
    dumped = {"role": "assistant", "content": "yo", "refusal": None, "tool_calls": None, "function_call": None,
              "audio": None, "annotations": None}  # fmt: skip
    expected = _tokenized(stack, key, plain).json()["tokens"]
    hinted = {"type": "text", "text": "yo", "cache_control": {"type": "ephemeral"}}
    for assistant in (dumped, dumped | {"tool_calls": [], "annotations": []},
                      {"role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
                      {"role": "assistant", "content": [hinted]}):  # fmt: skip
        reply = _tokenized(stack, key, [user, assistant, user])
        assert reply.status_code == 200 and reply.json()["tokens"] == expected, (assistant, reply.text)
    empty = _tokenized(stack, key, [user, {"role": "assistant", "content": None}, user])
    assert (
        empty.json()["tokens"]
        == _tokenized(stack, key, [user, {"role": "assistant", "content": ""}, user]).json()["tokens"]
    )
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    refused = httpx.post(f"{stack.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                         json={"model": MODEL, "messages": [user, {"role": "assistant", "content": None,
                                                                   "tool_calls": call}]})  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.1.tool_calls", refused.text


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format.type", "Input should be 'text'"),
        ({"tool_choice": "auto"}, "tool_choice", "Input should be 'none'"),
        (
            {"continue_final_message": True},
            None,
            "Cannot set both `continue_final_message` and `add_generation_prompt`",
        ),
        ({"continue_final_message": True, "add_generation_prompt": False}, None, "needs an assistant message last"),
        ({"chat_template_kwargs": {"tokenize": False}}, None, "chat_template_kwargs may not set tokenize"),
        ({"chat_template_kwargs": {"return_tensors": "pt"}}, None, "chat_template_kwargs may not set return_tensors"),
    ],
)
def test_chat_template_controls_refused_as_vllm_refuses_them(
    stack: Stack, key: str, fields: dict[str, Any], param: str | None, message: str
) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2} | fields
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=10)  # fmt: skip
    error = reply.json()["error"]
    assert (reply.status_code, error["code"], error["param"]) == (400, "invalid_request", param), error
    assert message in error["message"], error
