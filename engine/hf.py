"""The embedded backend: HF transformers on CPU or GPU, batch size one."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from prfaas.engine.base import DecodeStep, ModelFacts, PrefillResult, check_prompt, end_of_sequence_ids
from prfaas.engine.blocks import block_hashes
from prfaas.engine.calibration import load_query_energy
from prfaas.engine.device import DeviceChoice
from prfaas.engine.errors import (
    InvalidPrompt,
    KVDtypeMismatch,
    KVShapeMismatch,
    ModelMismatch,
    PromptTooLong,
)
from prfaas.engine.kv import DTYPES, KVCache, LayerKV, hash_token_ids
from prfaas.engine.models import model_fingerprint, resolve_model
from prfaas.engine.prefix_cache import PrefixCache
from prfaas.engine.sampling import Chosen, History, SamplingParams, TokenLogprobs, choose, token_logprobs

PROMPT_LOGPROBS_CHUNK = 256  # prompt positions whose logits are computed at once (prompt logprobs)
# (layer, k, v); k, v: [kv_heads, tokens, head_dim], the cache's own tensors (no copy)
OnLayer = Callable[[int, torch.Tensor, torch.Tensor], None]


class _TappedCache(DynamicCache):
    """A prefill cache that hands each layer's K/V to `on_layer` as soon as the layer writes
    them: right after its K/V projections (and RoPE), before that layer's attention and MLP,
    which never change them. So the last layer's KV leaves while the last layer still computes."""

    def __init__(self, config: Any, on_layer: OnLayer) -> None:
        super().__init__(config=config)
        self._on_layer = on_layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        # [1, kv_heads, tokens, head_dim]; batch size is one. A prefill writes each layer once.
        self._on_layer(layer_idx, keys[0].contiguous(), values[0].contiguous())
        return keys, values


class HFEngine:
    """A model folder loaded with transformers.

    model: a catalog name (prepared) or a path to an HF model folder.
    dtype: "float32", "bfloat16" or "float16"; KV caches carry it and must match on decode.
    prefix_cache: where prompts' KV is kept for reuse (None: every prompt is computed whole).
    """

    device_choice: DeviceChoice | None = None  # what region/build.py chose it to run on

    def __init__(
        self, model: str | Path, *, dtype: str = "float32", device: str = "cpu", cpus: Sequence[int] | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:  # fmt: skip
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.path = resolve_model(model)
        self._fingerprint = model_fingerprint(self.path)
        self._dtype = dtype
        self.device = torch.device(device)
        loaded: Any = AutoModelForCausalLM.from_pretrained(self.path, dtype=DTYPES[dtype], local_files_only=True)
        self.model: Any = loaded.to(self.device).eval()
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.num_layers = int(config.num_hidden_layers)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self._max_context = int(config.max_position_embeddings)
        self.eos_token_ids = end_of_sequence_ids(self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id)
        self.cpus = frozenset(cpus) if cpus else None  # each forward runs pinned to these
        self.prefix_cache = prefix_cache
        self.facts = ModelFacts(
            fingerprint=self._fingerprint, dtype=dtype, vocab_size=self.vocab_size, num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, max_context=self._max_context,
            eos_token_ids=self.eos_token_ids, eos_token_id=self.tokenizer.eos_token_id,
        )  # fmt: skip
        # the query energy the kv codecs shape key scales by (`prfaas model calibrate`); None: not calibrated
        self.query_energy = load_query_energy(self._fingerprint, self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def dtype(self) -> str:
        return self._dtype

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def kv_bytes_per_token(self) -> int:
        return self.facts.kv_bytes_per_token

    def check_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """InvalidPrompt / PromptTooLong unless this engine can run `token_ids` with `params`."""
        check_prompt(self.facts, token_ids, params)

    def _check_kv(self, kv: KVCache, params: SamplingParams) -> None:
        if kv.model_fingerprint != self._fingerprint:
            raise ModelMismatch(
                f"KV cache was produced by model {kv.model_fingerprint[:16]}..., "
                f"this engine runs {self._fingerprint[:16]}... ({self.path.name})"
            )
        if kv.dtype != self._dtype:
            raise KVDtypeMismatch(f"KV cache dtype {kv.dtype} does not match engine dtype {self._dtype}")
        expected = (self.num_kv_heads, kv.num_tokens, self.head_dim)
        if kv.num_layers != self.num_layers or any(tuple(layer.k.shape) != expected for layer in kv.layers):
            raise KVShapeMismatch(
                f"KV cache has {kv.num_layers} layers, expected {self.num_layers} of shape {list(expected)}"
            )
        if kv.num_tokens == 0:
            raise InvalidPrompt("KV cache covers no tokens")
        params.check_vocab(self.vocab_size)
        if kv.num_tokens + params.max_new_tokens > self._max_context:
            raise PromptTooLong(
                f"KV cache of {kv.num_tokens} tokens plus max_new_tokens {params.max_new_tokens} exceeds "
                f"the model's context of {self._max_context} tokens"
            )

    def _forward(self, input_ids: list[int], cache: DynamicCache) -> torch.Tensor:
        """Run tokens through the model, appending to `cache`; last position's logits [vocab]."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        with pinned(self.cpus):
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits: torch.Tensor = out.logits[0, -1].float().cpu()
        return logits

    def _forward_prompt(
        self, input_ids: list[int], cache: DynamicCache, k: int
    ) -> tuple[torch.Tensor, tuple[TokenLogprobs, ...]]:
        """`_forward`, and the logprobs of each prompt token after the first given the ones before it,
        with the top `k` there: the output head runs over the positions in chunks (a [tokens, vocab]
        tensor at once would take tokens x vocab x 4 bytes). The last position's logits are the same
        as `_forward`'s: the same decoder and head, on the last position's hidden state."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
        with pinned(self.cpus):
            hidden = decoder(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[0]
            last: torch.Tensor = head(hidden[-1:]).float().cpu()[0]
            prompt: list[TokenLogprobs] = []
            for start in range(0, len(input_ids) - 1, PROMPT_LOGPROBS_CHUNK):
                end = min(start + PROMPT_LOGPROBS_CHUNK, len(input_ids) - 1)
                logits = head(hidden[start:end]).float().cpu()
                prompt += [token_logprobs(logits[i], input_ids[start + i + 1], k) for i in range(end - start)]
        return last, tuple(prompt)

    @torch.inference_mode()
    def prefill(
        self, token_ids: Sequence[int], params: SamplingParams, *, on_layer: OnLayer | None = None,
        cache_salt: str | None = None,
    ) -> PrefillResult:  # fmt: skip
        """`on_layer(layer, k, v)`, if given, runs in this thread as soon as each layer's KV is
        in the cache (before the rest of that layer computes); the tensors are the result's
        own KV (the whole prompt's, a cached prefix included), never written again. An
        exception it raises aborts the forward (cancel).

        `cache_salt` (not None, and the engine has a prefix cache): the prompt's leading blocks
        held in the prefix cache under that salt are reused and only the rest is computed (at
        least the last token is: its logits choose the first token); the prompt's full blocks
        are kept there afterwards. Prompt logprobs need every position's hidden state, so a
        prompt that asks for them is computed whole."""
        self.check_prompt(token_ids, params)
        params.check_vocab(self.vocab_size)
        config = self.model.config
        cache = DynamicCache(config=config) if on_layer is None else _TappedCache(config, on_layer)
        store = self.prefix_cache if cache_salt is not None else None
        digests = [] if store is None else block_hashes(token_ids, store.block_tokens, cache_salt or "")
        hit = None
        if store is not None and params.prompt_logprobs is None:
            hit = store.lookup(digests[: (len(token_ids) - 1) // store.block_tokens])
        start = 0
        if hit is not None:
            for index, (k, v) in enumerate(hit.layers):  # not through the tap: on_layer sees whole layers
                DynamicCache.update(cache, k.unsqueeze(0).to(self.device), v.unsqueeze(0).to(self.device), index)
            start = hit.num_tokens
        prompt: tuple[TokenLogprobs, ...] = ()
        if params.prompt_logprobs is None:
            logits = self._forward(list(token_ids[start:]), cache)
        else:
            logits, prompt = self._forward_prompt(list(token_ids), cache, params.prompt_logprobs)
        # cache layers hold k, v: [1, kv_heads, tokens, head_dim]; drop the batch dim.
        cache_layers: list[Any] = list(cache.layers)
        layers = tuple(LayerKV(k=layer.keys[0].contiguous(), v=layer.values[0].contiguous()) for layer in cache_layers)
        kv = KVCache(
            model_fingerprint=self._fingerprint,
            dtype=self._dtype,
            layers=layers,
            num_tokens=len(token_ids),
            token_ids_hash=hash_token_ids(token_ids),
        )
        if store is not None:
            store.insert(digests, [(layer.k, layer.v) for layer in layers])
        history = History(prompt=token_ids)
        firsts = tuple(choose(logits, params.for_choice(c), 0, history, self.eos_token_ids) for c in range(params.n))
        if prompt:
            firsts = (dataclasses.replace(firsts[0], prompt=prompt), *firsts[1:])
        return PrefillResult(kv=kv, first_token=firsts[0].token, logits=logits, first=firsts[0], firsts=firsts,
                             cached_tokens=start)  # fmt: skip

    def decode_steps(
        self, kv: KVCache, first_token: int, params: SamplingParams, prompt_ids: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> Iterator[DecodeStep]:  # fmt: skip
        """Like `decode`, with the logits each token was chosen from (for quality checks). `cache_salt`: the
        KV goes to the prefix cache under `prompt_ids`' blocks only when they hash to `kv.token_ids_hash`."""
        self._check_kv(kv, params)
        if not 0 <= first_token < self.vocab_size:
            raise InvalidPrompt(f"first token {first_token} is outside the vocabulary [0, {self.vocab_size})")
        if params.repetition_penalty != 1.0 and len(prompt_ids) != kv.num_tokens:
            raise InvalidPrompt("repetition_penalty needs the prompt's token ids beside its KV")
        if cache_salt is not None and (
            len(prompt_ids) != kv.num_tokens or hash_token_ids(prompt_ids) != kv.token_ids_hash
        ):  # another prompt's ids would file this KV under them, for later prefills of that prompt to reuse
            cache_salt = None  # decoding from the KV alone is still fine: it is just not kept
        return self._decode_steps(kv, first_token, params, prompt_ids, cache_salt)

    @torch.inference_mode()
    def _decode_steps(
        self, kv: KVCache, first_token: int, params: SamplingParams, prompt_ids: Sequence[int],
        cache_salt: str | None,
    ) -> Iterator[DecodeStep]:  # fmt: skip
        cache = DynamicCache(config=self.model.config)
        for index, layer in enumerate(kv.layers):
            cache.update(layer.k.unsqueeze(0).to(self.device), layer.v.unsqueeze(0).to(self.device), index)
        output = [first_token]
        history = History(prompt=prompt_ids, output=output)  # `output` grows in place
        failed = False
        try:
            for step in range(1, params.max_new_tokens):
                if ends(output[-1], params, self.eos_token_ids):
                    return
                logits = self._forward([output[-1]], cache)
                chosen = choose(logits, params, step, history, self.eos_token_ids)
                output.append(chosen.token)
                yield DecodeStep(token=chosen.token, logits=logits, chosen=chosen)
        except BaseException as exc:
            failed = not isinstance(exc, GeneratorExit)  # a forward that raised may have left layers uneven
            raise
        finally:  # ended, or closed early: what the cache holds is the prompt and the tokens fed so far
            if cache_salt is not None and not failed:
                self._remember([*prompt_ids, *output], cache, cache_salt)

    def _remember(self, token_ids: Sequence[int], cache: DynamicCache, cache_salt: str) -> None:
        """Keep the full blocks of `token_ids` whose KV `cache` holds in the prefix cache."""
        store = self.prefix_cache
        if store is None:
            return
        layers: list[Any] = list(cache.layers)
        covered = min((0 if layer.keys is None else int(layer.keys.shape[2]) for layer in layers), default=0)
        digests = block_hashes(token_ids[:covered], store.block_tokens, cache_salt)
        store.insert(digests, [(layer.keys[0], layer.values[0]) for layer in layers])

    def decode(
        self, kv: KVCache, first_token: int, params: SamplingParams, prompt_ids: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> Iterator[int]:  # fmt: skip
        return (step.token for step in self.decode_steps(kv, first_token, params, prompt_ids, cache_salt))

    def decode_chosen(
        self,
        kv: KVCache,
        first_token: int,
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> Iterator[Chosen]:
        """The tokens of `decode` with their logprobs (when `params.logprobs` asks). `cache_salt` (not
        None): the prompt's and the generated tokens' full blocks go to the prefix cache at the end."""
        return (step.chosen for step in self.decode_steps(kv, first_token, params, prompt_ids, cache_salt))

    def generate(self, token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None = None) -> list[int]:
        """Colocated generation: prefill and decode in this process (stop strings not applied)."""
        result = self.prefill(token_ids, params, cache_salt=cache_salt)
        return [result.first_token, *self.decode(result.kv, result.first_token, params, token_ids, cache_salt)]

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        if chat:
            messages = [{"role": "user", "content": text}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode_text(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


def ends(token: int, params: SamplingParams, eos_token_ids: frozenset[int]) -> bool:
    """Whether generation stops after `token` (end of sequence, unless ignored; a stop token id).
    Before `min_tokens`, neither can be chosen (sampling.process)."""
    return (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the block with this thread on `cpus` only (Linux: a thread's own affinity; threads
    it starts meanwhile inherit it), then put its affinity back. None: no change."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
