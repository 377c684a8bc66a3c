"""The OpenAI-compatible generation requests (`POST /v1/completions`, `POST /v1/chat/completions`): OpenAI's
fields, vLLM's extras and our `prfaas` extension, each checked as vLLM checks it; docs/control-plane.md has
the table."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

# auto: the scheduler decides; local / split: forced (tenants allowed to); auto-prefix-blind and
# auto-residency-blind: the scheduler decides without prefix caches, or without knowing where they hold what
# (benchmark baselines: control_plane/jobs/prefix.py)
Placement = Literal["auto", "local", "split", "auto-prefix-blind", "auto-residency-blind"]


class PrfaasOptions(BaseModel):
    """The request's `prfaas` extension: where it may run and what it asks of the placement (each left
    unset takes the tenant's default, then the control plane's; control_plane/jobs/objectives.py)."""

    model_config = ConfigDict(extra="forbid")
    placement: Placement = "auto"
    ttft_slo_ms: float | None = Field(default=None, gt=0, le=3_600_000, allow_inf_nan=False,
                                      description="time to first token objective, ms")  # fmt: skip
    tpot_slo_ms: float | None = Field(default=None, gt=0, le=600_000, allow_inf_nan=False,
                                      description="time per output token objective, ms")  # fmt: skip
    kv_codec: str | None = Field(
        default=None, min_length=1, max_length=32,
        description="lossless (the KV crosses the WAN bit for bit), or a lossy codec of the policy it may use",
    )  # fmt: skip


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False  # null: not asked, as vLLM reads it
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk too (with include_usage)


TokenId = Annotated[int, Field(ge=0, lt=2**32)]
Stop = Annotated[str, Field(min_length=1, max_length=256)]
MAX_STOP_STRINGS = 4  # OpenAI's "up to 4 sequences", vLLM's VLLM_MAX_STOP_STRINGS default
MetadataKey = Annotated[str, Field(max_length=64)]  # OpenAI's limits: 16 pairs, keys of 64, values of 512 characters
MetadataValue = Annotated[str, Field(max_length=512)]
# Parameters of OpenAI's schemas that prfaas does not implement: refused with 400 `unsupported_parameter`
# (api/errors.py) unless null. The lists are walked by tests/control_plane/api/test_openai_params.py.
REFUSED_COMPLETION = ("best_of", "suffix")
REFUSED_CHAT = (
    "audio", "function_call", "functions", "modalities", "moderation", "prediction", "prompt_cache_options",
    "prompt_cache_retention", "reasoning_effort", "tools", "verbosity", "web_search_options",
)  # fmt: skip
# names chat_template_kwargs may not set: the rendering's own arguments (transformers' apply_chat_template's)
TEMPLATE_OWN = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


class _Generation(BaseModel):
    """The sampling fields both endpoints share: OpenAI's, and vLLM's extras (`top_k`, `min_p`,
    `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`). Unknown fields are refused
    (400 naming them), never ignored; docs/control-plane.md has the table."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=256, description="omitted, null or empty: the served model")
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0, allow_inf_nan=False)
    min_tokens: int | None = Field(default=None, ge=0)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=16)] | None = None
    ignore_eos: bool | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # vLLM's range; -1 is no seed
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300)] | None = None
    n: int | None = Field(default=None, ge=1, le=16, description="choices per prompt: one prefill, n decodes")
    user: str | None = Field(default=None, max_length=256)
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="vLLM's: prefix cache blocks are shared only among requests with the same salt (within the "
        "tenant's scope, PRFAAS_PREFIX_SCOPE)",
    )  # fmt: skip
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    prfaas: PrfaasOptions | None = None

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and options.model_fields_set and not info.data.get("stream"):  # vLLM's (`{}`: none)
            raise PydanticCustomError("stream_options", "Stream options can only be defined when `stream=True`.")
        return options


class CompletionCreate(_Generation):
    prompt: (
        Annotated[str, Field(min_length=1, max_length=4_000_000)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=4_000_000)]], Field(min_length=1, max_length=64)]
        | Annotated[list[TokenId], Field(min_length=1, max_length=1_000_000)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: with `echo` only (the prompt scored, vLLM's)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: None = None
    suffix: None = None

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens` 0: the prompt alone comes back (with its logprobs when asked), as vLLM
        answers it: one token is generated (in `usage` and `finish_reason`), not shown."""
        return bool(self.echo) and self.max_tokens == 0


class ContentPart(BaseModel):
    """A text part; `input_text` / `output_text` (the Responses API's names) are text too, as vLLM reads them."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "input_text", "output_text"]
    text: str = Field(max_length=4_000_000)
    cache_control: dict[str, Any] | None = None  # a caching hint some clients add to parts: no effect here


class ResponseFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class ChatMessage(BaseModel):
    """A message; an assistant message as the SDK returns it (`choices[0].message`, sent back as it is) is taken:
    its `refusal`, `annotations` and empty or null `tool_calls`, `function_call` and `audio` change nothing, and
    null content is empty, as vLLM reads them."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=4_000_000)] | Annotated[list[ContentPart], Field(max_length=100)] | None
    name: str | None = Field(default=None, max_length=256)
    refusal: str | None = Field(default=None, max_length=4_000_000)
    annotations: list[Any] | None = Field(default=None, max_length=100)
    tool_calls: Annotated[list[Any], Field(max_length=0)] | None = None  # tools are not supported: none made
    function_call: None = None
    audio: None = None

    def text(self) -> str:
        """The content as the chat template reads it (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def for_template(self) -> dict[str, str]:
        """The message as the chat template is given it: role, text and, when set, name (as vLLM passes it)."""
        return {"role": self.role, "content": self.text()} | ({"name": self.name} if self.name else {})


class ChatCompletionCreate(_Generation):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1000)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # accepted with no effect, as OpenAI documents them: identifiers and hints for OpenAI's own services
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    parallel_tool_calls: bool | None = None
    audio: None = None
    function_call: None = None
    functions: None = None
    modalities: None = None
    moderation: None = None
    prediction: None = None
    prompt_cache_options: None = None
    prompt_cache_retention: None = None
    reasoning_effort: None = None
    response_format: ResponseFormatText | None = None  # plain text, the default: other formats are not supported
    tool_choice: Literal["none"] | None = None  # no tools here: "none" is what runs
    tools: None = None
    # vLLM's chat template controls
    add_generation_prompt: bool = True  # the assistant turn's opening after the messages
    continue_final_message: bool = False  # the last (assistant) message continued, not closed: a prefill
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=32)  # e.g. enable_thinking
    verbosity: None = None
    web_search_options: None = None

    @model_validator(mode="after")
    def _template_controls(self) -> ChatCompletionCreate:
        if self.add_generation_prompt and self.continue_final_message:  # vLLM's refusal
            raise PydanticCustomError(
                "template", "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise PydanticCustomError("template", "continue_final_message needs an assistant message last")
        own = sorted(TEMPLATE_OWN & set(self.chat_template_kwargs or {}))
        if own:
            raise PydanticCustomError("template", "chat_template_kwargs may not set {own}", {"own": ", ".join(own)})
        return self
