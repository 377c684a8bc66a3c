"""`TokenStream`: the token events of a decode (split or local), every choice in turn, with
vLLM's finish rules. Shared by Decode and Generate (agent.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prfaas.decode_region import metrics
from prfaas.decode_region.backend import close_tokens
from prfaas.engine.base import ModelFacts
from prfaas.engine.sampling import Chosen, SamplingParams
from prfaas.engine.stops import TextStops
from prfaas.protos.prfaas.v1 import decode_pb2
from prfaas.region.errors import Canceled, DeadlineExceeded
from prfaas.region.requests import logprobs_to_proto, prompt_logprobs_to_proto


class TokenStream:
    """One call's stream. `decode_text` is the model's detokenizer (stop strings); `path`
    labels the token counter ("split" or "local"). After `events` ended, `rate` is the
    decode tokens/s past each choice's first token (None when no such token was made)."""

    def __init__(self, facts: ModelFacts, decode_text: Callable[[list[int]], str], path: str) -> None:
        self.eos_token_ids, self.eos_token_id = facts.eos_token_ids, facts.eos_token_id
        self.decode_text = decode_text
        self.path = path
        self.rate: float | None = None

    def finish(self, chosen: Chosen, index: int, stops: TextStops | None, params: SamplingParams) -> tuple[str, str]:
        """(finish reason, stop reason) after a choice's token `index`, in vLLM's order (v1 `check_stop`, then its
        detokenizer): end of sequence, stop token id, length, and a stop string the token completed, which wins
        over length; ("", "") to go on. So a last allowed token that ends the sequence is a stop, not length. An
        end-of-sequence id of the generation config other than the tokenizer's is a stop token id to vLLM
        (`update_from_generation_config`): its id is the stop reason."""
        token = chosen.token
        if token in self.eos_token_ids and not params.ignore_eos:
            return ("eos", "") if token == self.eos_token_id else ("stop_token", str(token))
        if token in params.stop_token_ids:
            return "stop_token", str(token)
        finish = "length" if index == params.max_new_tokens - 1 else ""
        if stops is not None:
            matched = stops.push(token)
            if matched is not None:
                return "stop", matched
        return finish, ""

    def events(
        self, firsts: list[Chosen] | None, rests: list[Iterator[Chosen]], params: SamplingParams,
        canceled: threading.Event, deadline: float, started: float, cached_tokens: int = 0,
    ) -> Iterator[decode_pb2.TokenEvent]:  # fmt: skip
        """Token events of every choice: step 0 of each (`firsts`, or the first item of its iterator),
        then one step of each unfinished choice in turn. A choice that finished has its iterator closed.
        `cached_tokens` (a local run's prefix cache hit) rides on choice 0's step 0."""
        stops = [TextStops(self.decode_text, params.stop, params.min_tokens) if params.stop else None
                 for _ in rests]  # fmt: skip
        steps = [0] * len(rests)
        active = list(range(len(rests)))
        t0 = time.monotonic()
        generated = 0
        while active:
            for choice in list(active):
                if generated:
                    if canceled.is_set():
                        raise Canceled("canceled during decode")
                    if time.monotonic() >= deadline:
                        raise DeadlineExceeded(f"decode deadline reached after {generated} tokens")
                chosen = firsts[choice] if firsts is not None and steps[choice] == 0 else next(rests[choice])
                finish, stop_reason = self.finish(chosen, steps[choice], stops[choice], params)
                metrics.TOKENS.labels(self.path).inc()
                yield decode_pb2.TokenEvent(
                    index=steps[choice], token=chosen.token, last=bool(finish), finish_reason=finish,
                    stop_reason=stop_reason, elapsed_s=time.monotonic() - started,
                    logprobs=logprobs_to_proto(chosen.logprobs), choice=choice,
                    prompt_logprobs=prompt_logprobs_to_proto(chosen),
                    cached_tokens=cached_tokens if generated == 0 else 0,
                )  # fmt: skip
                steps[choice] += 1
                generated += 1
                if finish:
                    active.remove(choice)
                    close_tokens(rests[choice])
        if generated > len(rests):
            self.rate = (generated - len(rests)) / max(time.monotonic() - t0, 1e-6)
