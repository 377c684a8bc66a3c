"""Scheduler policy: the YAML document, its validated model, and the builder.

`parse_policy(text)` / `load_policy(path)` give a `PolicyConfig` or raise `PolicyConfigError`
naming the offending field; `build_scheduler(config, registry)` turns it into a
`GlobalScheduler` (plugin parameters are validated by each plugin's factory there). Every key
is documented in docs/scheduler.md; `DEFAULT_POLICY_YAML` is the policy used when none is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prfaas.control_plane.scheduling.costmodel import CodecOption, CostModel
from prfaas.control_plane.scheduling.errors import PolicyConfigError
from prfaas.control_plane.scheduling.plugin_registry import PluginRegistry, default_registry, validation_message
from prfaas.control_plane.scheduling.scheduler import (
    DisaggregationRule,
    GlobalScheduler,
    NamedFilter,
    Profile,
    WeightedScorer,
)

# The policy used when none is given: a data file beside this module (docs/scheduler.md explains each key).
DEFAULT_POLICY_YAML = (Path(__file__).parent / "default_policy.yaml").read_text(encoding="utf-8")


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FilterSpec(_Strict):
    type: str = Field(min_length=1)
    name: str | None = Field(default=None, description="label in traces; defaults to the type")
    params: dict[str, Any] = Field(default_factory=dict)


class ScorerSpec(FilterSpec):
    weight: float = Field(default=1.0, ge=0, allow_inf_nan=False)


class PickerSpec(_Strict):
    type: str = Field(default="max-score", min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)


class ProfileSpec(_Strict):
    filters: list[FilterSpec] = Field(default_factory=list)
    scorers: list[ScorerSpec] = Field(default_factory=list)
    picker: PickerSpec = Field(default_factory=PickerSpec)

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        for kind, specs in (("filters", self.filters), ("scorers", self.scorers)):
            seen: set[str] = set()
            for spec in specs:
                label = spec.name or spec.type
                if label in seen:
                    raise ValueError(f"two {kind} named {label!r}; give one a distinct `name`")
                seen.add(label)
        return self


class ProfilesSpec(_Strict):
    decode: ProfileSpec
    prefill: ProfileSpec


class DisaggregationSpec(_Strict):
    min_uncached_tokens: int = Field(default=19_400, ge=0)
    min_cost_gain: float = Field(default=0.1, ge=0, lt=1)
    min_ttft_gain: float = Field(default=0.1, ge=0, lt=1)
    max_decode_regions_tried: int = Field(default=4, ge=1)


class CodecSpec(_Strict):
    name: str = Field(min_length=1)
    compression_ratio: float = Field(ge=1, allow_inf_nan=False, description="raw bytes / wire bytes")
    lossy: bool = False
    encode_gbps: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="raw Gbit/s encoded")
    # its measured quality (lossy codecs; informational: GET /v1/models lists it for tenants choosing consent)
    token_agreement: float | None = Field(default=None, ge=0, le=1, description="greedy continuation agreement")
    teacher_forced_agreement: float | None = Field(default=None, ge=0, le=1, description="top-1, teacher-forced")
    delta_ppl_pct: float | None = Field(default=None, allow_inf_nan=False, description="perplexity change, %")


class TransferSpec(_Strict):
    codecs: list[CodecSpec] = Field(min_length=1)
    stream_window_bytes: int = Field(default=4 * 2**20, ge=1)
    min_streams: int = Field(default=1, ge=1)
    max_streams: int = Field(default=64, ge=1)
    lossy_min_exposed_share: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="a consented lossy codec is used only when the best lossless plan's "
        "exposed transfer is at least this share of its TTFT (a slow link), or fits no TTFT budget",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        names = [codec.name for codec in self.codecs]
        if len(set(names)) != len(names):
            raise ValueError(f"codec names repeat: {names}")
        if all(codec.lossy for codec in self.codecs):
            raise ValueError("at least one codec must be lossless (requests may forbid lossy ones)")
        if self.min_streams > self.max_streams:
            raise ValueError(f"min_streams ({self.min_streams}) exceeds max_streams ({self.max_streams})")
        return self


class CostSpec(_Strict):
    prefill_on_spot: bool = True


class PolicyConfig(_Strict):
    version: Literal[1] = 1
    disaggregation: DisaggregationSpec = Field(default_factory=DisaggregationSpec)
    transfer: TransferSpec
    cost: CostSpec = Field(default_factory=CostSpec)
    profiles: ProfilesSpec


def policy_from_mapping(document: Mapping[str, Any]) -> PolicyConfig:
    try:
        return PolicyConfig.model_validate(dict(document))
    except ValidationError as exc:
        raise PolicyConfigError(*validation_message(exc)) from None


def parse_policy(text: str) -> PolicyConfig:
    """Validate a YAML policy document. A key repeated in one mapping is an error naming it (YAML
    loaders keep the last silently: a section tuned at the top and left below was lost)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _refuse_repeated_keys(node, "", set())
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyConfigError("", f"policy is not valid YAML: {exc}") from None
    if not isinstance(document, dict):
        raise PolicyConfigError("", f"policy must be a YAML mapping, got {type(document).__name__}")
    return policy_from_mapping(document)


def _refuse_repeated_keys(node: yaml.Node | None, path: str, seen: set[int]) -> None:
    """PolicyConfigError naming the dotted path of a key a mapping under `node` repeats, and its lines.
    `seen`: nodes walked already (an alias names its anchor's node again; it may even hold itself)."""
    if node is None or id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_repeated_keys(item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                _refuse_repeated_keys(value, path, seen)  # a complex key is refused by the schema; `<<` merges
                continue
            where = f"{path}.{key.value}" if path else str(key.value)
            line = key.start_mark.line + 1
            if (key.tag, key.value) in first_line:
                raise PolicyConfigError(
                    where, f"key repeated (lines {first_line[key.tag, key.value]} and {line}): keep one"
                )
            first_line[key.tag, key.value] = line
            _refuse_repeated_keys(value, where, seen)


def load_policy(path: str | Path) -> PolicyConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyConfigError("", f"cannot read policy {path}: {exc.strerror}") from None
    return parse_policy(text)


def default_policy() -> PolicyConfig:
    return parse_policy(DEFAULT_POLICY_YAML)


def _profile(spec: ProfileSpec, registry: PluginRegistry, where: str) -> Profile:
    filters = [
        NamedFilter(f.name or f.type, registry.make_filter(f.type, f.params, f"{where}.filters[{i}]"))
        for i, f in enumerate(spec.filters)
    ]
    scorers = [
        WeightedScorer(s.name or s.type, s.weight, registry.make_scorer(s.type, s.params, f"{where}.scorers[{i}]"))
        for i, s in enumerate(spec.scorers)
    ]
    picker = registry.make_picker(spec.picker.type, spec.picker.params, f"{where}.picker")
    return Profile(tuple(filters), tuple(scorers), picker)


def build_scheduler(config: PolicyConfig | None = None, registry: PluginRegistry | None = None) -> GlobalScheduler:
    """The scheduler a policy describes (the default policy and built-in plugins if omitted)."""
    config = config or default_policy()
    registry = registry or default_registry()
    transfer = config.transfer
    codecs = [
        CodecOption(c.name, c.compression_ratio, c.lossy, None if c.encode_gbps is None else c.encode_gbps * 1e9 / 8)
        for c in transfer.codecs
    ]
    cost_model = CostModel(
        codecs,
        stream_window_bytes=transfer.stream_window_bytes,
        min_streams=transfer.min_streams,
        max_streams=transfer.max_streams,
        prefill_on_spot=config.cost.prefill_on_spot,
        lossy_min_exposed_share=transfer.lossy_min_exposed_share,
    )
    rules = config.disaggregation
    return GlobalScheduler(
        decode=_profile(config.profiles.decode, registry, "profiles.decode"),
        prefill=_profile(config.profiles.prefill, registry, "profiles.prefill"),
        cost_model=cost_model,
        rule=DisaggregationRule(rules.min_uncached_tokens, rules.min_cost_gain, rules.min_ttft_gain),
        max_decode_regions_tried=rules.max_decode_regions_tried,
    )
