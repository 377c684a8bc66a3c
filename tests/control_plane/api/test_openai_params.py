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
from prfaas.devstack.stack import Stack

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
        ({"stop": [""]}, "stop", "invalid_request"),
    ],
)
def test_out_of_range_sampling_gets_400_naming_it(
    stack: Stack, key: str, fields: dict[str, Any], param: str, code: str
) -> None:
    client = openai_client(stack, key, 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **fields)
    assert (info.value.code, info.value.param) == (code, param), info.value.message


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
