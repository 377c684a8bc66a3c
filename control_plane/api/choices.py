"""One choice of a generation response, built token by token as vLLM's OpenAI server builds it.

- Text: the tokens' incremental text (engine/stops.py), cut before the stop string that ended
  it; the text of an end-of-sequence or stop token id that ended it is not shown (the token
  counts in `usage`). A stream holds back what could still start a stop string.
- `finish_reason`: "length" when `max_tokens` ran out, else "stop" (end of sequence, a stop
  token id, a stop string); `stop_reason` (vLLM's field): the stop string, the stop token id,
  or null.
- Logprobs of the raw logits: a completion's `{tokens, token_logprobs, top_logprobs,
  text_offset}` with up to k + 1 entries per token (the chosen one first, then the top k, a token
  listed once), a chat's `content: [{token, logprob, bytes, top_logprobs}]` with k. Token
  strings are each token decoded alone, special tokens shown; one that ends inside a UTF-8
  character is decoded after up to 4 preceding chosen tokens and given the text it completes,
  or "" (vLLM's `LogprobsProcessor`). -inf is sent as -9999.0.
"""

from __future__ import annotations

from typing import Any

from prfaas.control_plane.jobs.tokenlog import Token
from prfaas.control_plane.services import ServedModel
from prfaas.engine.sampling import SamplingParams, TokenLogprobs
from prfaas.engine.stops import TextStops

LOGPROB_FLOOR = -9999.0


class Choice:
    def __init__(
        self,
        model: ServedModel,
        params: SamplingParams,
        chat: bool,
        index: int,
        echo: str = "",
        echo_only: bool = False,
    ) -> None:
        """`echo_only` (`echo` with `max_tokens` 0): the text and logprobs are the prompt's alone; the token the
        engine generated counts in `usage` and gives `finish_reason`, as vLLM answers it."""
        self.model = model
        self.echo_only = echo_only
        self.chat = chat
        self.index = index
        self.k = params.logprobs
        self.stops = TextStops(model.decode, params.stop, params.min_tokens)
        self.echo = echo
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs | None] = []
        self.finish: str | None = None
        self.stop_reason: str | int | None = None
        self._shown = -1  # characters of the visible text already streamed; -1: nothing yet (not even the echo)
        self._lp_shown = 0  # tokens streamed (a chunk each, with their logprobs when asked)
        self._offset = 0  # text_offset of the next token (completions): the echoed prompt's tokens come first
        self.prompt_ids: list[int] = []  # echo with logprobs: the prompt's tokens (set once tokenized)
        self.prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # ... and their logprobs (from token 0)
        self._echo_logprobs = params.prompt_logprobs is not None  # asked (echo with logprobs), even of a "" echo

    def add(self, token: Token) -> None:
        if token.prompt_logprobs:  # the job's first token carries them (PromptJob.add gives them to every choice)
            self.prompt_logprobs = token.prompt_logprobs
        self.tokens.append(token.token)
        self.logprobs.append(token.logprobs)
        hidden = token.last and token.finish_reason in ("eos", "stop_token")
        if not hidden and self.stops.stopped is None:
            self.stops.push(token.token)
        if not token.last:
            return
        if self.stops.stopped is not None:
            self.finish, self.stop_reason = "stop", self.stops.stopped
        elif token.finish_reason == "length":
            self.finish = "length"
        else:
            self.finish = "stop"
            if token.finish_reason == "stop_token":
                self.stop_reason = int(token.stop_reason)
            elif token.finish_reason == "stop":
                self.stop_reason = token.stop_reason

    @property
    def text(self) -> str:
        return self.echo if self.echo_only else self.echo + self.stops.text

    def full(self) -> dict[str, Any]:
        """The choice of a whole (non-streamed) response."""
        return self._shape(self.text, self._logprobs(0, len(self.tokens)), self.finish or "length", whole=True)

    def chunk(self) -> dict[str, Any] | None:
        """The next streamed chunk's choice: new visible text and logprobs since the last one,
        and the finish on the last; a chunk for each new token even when its text is held back (an incomplete
        character, a stop string's possible start: text ""), as vLLM streams them; None when there is nothing
        new to send."""
        visible = "" if self.echo_only else self.stops.visible(self.finish is not None)
        start = max(self._shown, 0)
        piece = (self.echo if self._shown < 0 else "") + visible[start:]
        self._shown = max(len(visible), start)
        logprobs = self._logprobs(self._lp_shown, len(self.tokens)) if self.k is not None else None
        new_tokens = len(self.tokens) > self._lp_shown and not self.echo_only
        self._lp_shown = len(self.tokens)
        if not piece and self.finish is None and logprobs is None and not new_tokens:
            return None
        return self._shape(piece, logprobs, self.finish, whole=False)

    def _shape(self, text: str, logprobs: dict[str, Any] | None, finish: str | None, *, whole: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["message" if whole else "delta"] = (
                {"role": "assistant", "content": text} if whole else {"content": text}
            )
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        choice["stop_reason"] = self.stop_reason if finish else None
        return choice

    def _text_at(self, position: int) -> Any:
        """How tokens read at output `position` (context: the chosen tokens before it)."""
        context = self.tokens[max(0, position - 4) : position]
        return lambda token: _token_text(self.model, token, context)

    def _logprobs(self, start: int, end: int) -> dict[str, Any] | None:
        if self.k is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(i) for i in range(start, end)]}
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if start == 0 and self._echo_logprobs:  # the prompt's tokens first; the first has no logprob
            for p, token in enumerate(self.prompt_ids):
                lp = self.prompt_logprobs[p - 1] if 0 < p <= len(self.prompt_logprobs) else None
                context = self.prompt_ids[max(1, p - 4) : p]  # vLLM's: the prompt tokens with a logprob
                text = self.model.token_text(token) if lp is None else _token_text(self.model, token, context)
                tokens.append(text)
                offsets.append(self._offset)
                self._offset += len(text)
                if lp is None:
                    token_logprobs.append(None)
                    top.append(None)
                    continue
                token_logprobs.append(max(lp.logprob, LOGPROB_FLOOR))
                ranked = _ranked(token, lp)[: self.k + 1]
                top.append({_token_text(self.model, t, context): max(v, LOGPROB_FLOOR) for t, v in ranked})
        for i in range(start, 0 if self.echo_only else end):
            token, lp, text_of = self.tokens[i], self.logprobs[i], self._text_at(i)
            text = text_of(token)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            if lp is None:  # not computed (an engine that does not report them)
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(max(lp.logprob, LOGPROB_FLOOR))
            top.append({text_of(t): max(v, LOGPROB_FLOOR) for t, v in _ranked(token, lp)[: self.k + 1]})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_entry(self, position: int) -> dict[str, Any]:
        token, lp, text_of = self.tokens[position], self.logprobs[position], self._text_at(position)
        text = text_of(token)
        entry: dict[str, Any] = {
            "token": text,
            "logprob": LOGPROB_FLOOR if lp is None else max(lp.logprob, LOGPROB_FLOOR),
        }
        entry["bytes"] = list(text.encode("utf-8", errors="replace"))
        ranked = [] if lp is None else _ranked(token, lp)[: self.k or 0]
        entry["top_logprobs"] = [
            {"token": (t := text_of(i)), "logprob": max(v, LOGPROB_FLOOR),
             "bytes": list(t.encode("utf-8", errors="replace"))}
            for i, v in ranked
        ]  # fmt: skip
        return entry


def _token_text(model: ServedModel, token: int, context: list[int]) -> str:
    """`token` decoded alone; if that ends inside a UTF-8 character, the text it completes after the
    shortest suffix of `context` that makes it whole, else "" (vLLM's `_correct_decoded_token`)."""
    text = model.token_text(token)
    if not text.endswith("\ufffd"):
        return text
    for n in range(1, len(context) + 1):
        ctx = context[-n:]
        full = model.tokenizer.decode([*ctx, token])
        if full.endswith("\ufffd"):
            continue
        clean = len(ctx)  # context tokens that were themselves partial characters belong to this one
        while clean > 0 and model.token_text(ctx[clean - 1]).endswith("\ufffd"):
            clean -= 1
        prefix = model.tokenizer.decode(ctx[:clean]) if clean else ""
        if full.startswith(prefix):
            return str(full[len(prefix) :])
        common = next(
            (i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), min(len(prefix), len(full))
        )
        return str(full[common:])
    return ""


def _ranked(token: int, lp: TokenLogprobs) -> list[tuple[int, float]]:
    """The chosen token first, then the top ones best first, each token once (vLLM's order)."""
    ranked = {token: lp.logprob}
    for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
        ranked.setdefault(t, v)
    return list(ranked.items())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }  # fmt: skip
