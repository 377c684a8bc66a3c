"""What the API process and the Celery worker share: the stores on one Redis client (the tenants' on the
control plane's database too), the served model's tokenizer and KV geometry, and the schedulers (one per
placement a request may ask for, all from the same policy)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jinja2
import redis
from sqlalchemy.engine import Engine

from prfaas.control_plane.db.engine import make_engine
from prfaas.control_plane.db.migrations import upgrade
from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.jobs.prefix import BLIND
from prfaas.control_plane.jobs.store import JobStore
from prfaas.control_plane.scheduling.policy import build_scheduler, default_policy, load_policy
from prfaas.control_plane.scheduling.scheduler import DisaggregationRule, GlobalScheduler
from prfaas.control_plane.scheduling.snapshot import KV_DTYPE_BYTES, ModelShape
from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import TenantStore

PLACEMENTS = ("auto", "local", "split")


class ServedModel:
    """The model's tokenizer (chat template included) and KV geometry; no weights. `fingerprint`: what
    every region must serve (`model_fingerprint` when set, else the folder's weights' if it has them)."""

    def __init__(self, name: str, fingerprint: str | None = None) -> None:
        self.name = name
        self._fingerprint = fingerprint

    @cached_property
    def fingerprint(self) -> str | None:
        """engine/models.py `model_fingerprint` of the served model; None where this host has no weights (a
        control plane with the tokenizer alone): regions are then not checked against it."""
        if self._fingerprint:
            return self._fingerprint
        from prfaas.engine.errors import ModelPrepareError
        from prfaas.engine.models import model_fingerprint

        try:
            return model_fingerprint(self._folder)
        except ModelPrepareError:
            return None

    @cached_property
    def _folder(self) -> Any:
        from prfaas.engine.models import resolve_model

        return resolve_model(self.name)

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._folder, local_files_only=True)

    @cached_property
    def _config(self) -> dict[str, Any]:
        config: dict[str, Any] = json.loads((self._folder / "config.json").read_text())
        return config

    @property
    def max_context(self) -> int:
        return int(self._config["max_position_embeddings"])

    @cached_property
    def shape(self) -> ModelShape:
        c = self._config
        head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
        layers = int(c["num_hidden_layers"])
        return ModelShape(
            name=self.name,
            num_layers=layers,
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * KV_DTYPE_BYTES["float32"],
            kv_dtype="float32",
        )  # fmt: skip  (regions that report another dtype are counted in theirs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:  # fmt: skip
        """The messages through the model's chat template. As vLLM renders them: a template that knows no
        `developer` role gets those messages as `system`, and the system messages then merged into one, first.
        ChatTemplateError when the template refuses them (its own check, or a continued message it hides)."""
        template = str(self.tokenizer.chat_template or "")
        knows_developer = '"developer"' in template or "'developer'" in template  # vLLM's test
        if not knows_developer and any(m["role"] == "developer" for m in messages):
            system = [m["content"] for m in messages if m["role"] in ("system", "developer") and m["content"]]
            rest = [m for m in messages if m["role"] not in ("system", "developer")]
            messages = [{"role": "system", "content": "\n\n".join(system)}, *rest]
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=True, **(template_kwargs or {}),
            )  # fmt: skip
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise ChatTemplateError(str(exc)[:500]) from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def decode_prompt(self, token_ids: list[int]) -> str:
        """A prompt of token ids as `echo` shows it: special tokens kept, as vLLM detokenizes a prompt."""
        return str(self.tokenizer.decode(token_ids))

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens shown (how vLLM names a token in logprobs)."""
        return str(self.tokenizer.decode([token_id]))


class ChatTemplateError(ValueError):
    """The model's chat template refused the messages (say, a role it does not know): the request's fault."""


@dataclass
class Services:
    settings: Settings
    redis: redis.Redis
    jobs: JobStore
    tenants: TenantStore
    regions: RegionRegistry
    model: ServedModel
    schedulers: dict[str, GlobalScheduler]
    kv_codecs: list[dict[str, Any]] = field(default_factory=list)  # the policy's codecs, with measured quality

    @classmethod
    def create(cls, settings: Settings) -> Services:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=5)
        database = make_engine(settings.ledger.url)
        upgrade(settings.ledger.url, engine=database)  # idempotent; processes starting together take turns
        policy = load_policy(settings.policy_path) if settings.policy_path else default_policy()
        auto = build_scheduler(policy)
        # Asked placements keep the policy's filters and scores; only the split rule changes.
        split = build_scheduler(policy)
        split.rule = DisaggregationRule(min_uncached_tokens=1, min_cost_gain=-1e9, min_ttft_gain=-1e9)
        local = build_scheduler(policy)
        local.rule = dataclasses.replace(local.rule, min_uncached_tokens=DisaggregationRule.NEVER)
        schedulers = {"auto": auto, "split": split, "local": local} | dict.fromkeys(BLIND, auto)  # no prefix hints
        served = ServedModel(settings.model, settings.model_fingerprint)
        return cls(
            settings, client, JobStore(client, settings), TenantStore(client, settings, database),
            RegionRegistry(client, settings, served=lambda: served.fingerprint, database=database), served, schedulers,
            [c.model_dump(exclude_none=True) for c in policy.transfer.codecs],
        )  # fmt: skip

    @cached_property
    def lossy_codecs(self) -> frozenset[str]:
        """The policy's lossy KV codecs: what a request's `prfaas.kv_codec` may consent to."""
        return frozenset(c.name for c in self.schedulers["auto"].cost_model.codecs if c.lossy)

    @property
    def database(self) -> Engine:
        """The control plane's database (db/): the tenants' tables and the ledger's."""
        return self.tenants.engine

    def close(self) -> None:
        self.redis.close()
        self.tenants.engine.dispose()
