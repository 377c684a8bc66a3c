"""The routes of vLLM's OpenAI server that clients use besides `/v1`: `GET /health` (200, no body),
`GET /version`, `POST /tokenize` (a prompt or chat messages -> token ids, with the model's
context) and `POST /detokenize` (token ids -> text). Tokenizing needs an API key, as `/v1` does;
errors have OpenAI's shape (api/errors.py)."""

from __future__ import annotations

from importlib import metadata
from typing import Annotated

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field

from prfaas.control_plane.api.deps import ServicesDep, TenantDep
from prfaas.control_plane.api.errors import TOKEN_OUT_OF_VOCAB, model_not_found
from prfaas.control_plane.api.openai_schemas import ChatMessage, TokenId
from prfaas.control_plane.services import Services

router = APIRouter(tags=["vllm-compatible"])


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str = Field(max_length=4_000_000)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=1000)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]


@router.get("/health")
def health() -> Response:
    return Response(status_code=200)


@router.get("/version")
def version() -> dict[str, str]:
    return {"version": metadata.version("prfaas")}


def _model(s: Services, name: str | None) -> None:
    """None or "": the served model, as vLLM (and the generation routes) take it."""
    if name and name != s.model.name:
        raise model_not_found(name, s.model.name)


@router.post("/tokenize")
def tokenize(body: TokenizeCompletion | TokenizeChat, _tenant: TenantDep, s: ServicesDep) -> dict[str, object]:
    _model(s, body.model)
    tokenizer = s.model.tokenizer
    if isinstance(body, TokenizeChat):
        messages = [m.for_template() for m in body.messages]
        tokens = s.model.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
    else:
        tokens = list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": s.model.max_context, "tokens": tokens, "token_strs": strs}


@router.post("/detokenize")
def detokenize(body: Detokenize, _tenant: TenantDep, s: ServicesDep) -> dict[str, str]:
    _model(s, body.model)
    if body.tokens and max(body.tokens) >= len(s.model.tokenizer):
        raise TOKEN_OUT_OF_VOCAB.error(param="tokens")
    return {"prompt": str(s.model.tokenizer.decode(body.tokens))}
