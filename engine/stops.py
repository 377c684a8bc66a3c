"""Generated text, token by token, and stop strings matched on it as vLLM (v1) matches them.

Both the decode region (to end generation at the token that completes a stop string) and the
API (to cut the text and to hold back what could still start one) run `TextStops` over the
same tokens with the same tokenizer, so they agree on where the output ends.

- Text grows incrementally (`Detokenizer`): a token whose bytes end inside a UTF-8 character
  adds nothing until a later token completes it; the concatenation equals decoding all tokens
  at once (special tokens skipped).
- A stop string is looked for only in text that the newest token could have completed (so an
  occurrence is found once, at its first token), and only once more than `min_tokens` tokens
  were generated; text from tokens up to `min_tokens` is not searched. When several complete
  in the same text, the one that ends first wins (ties: the first in `stop`).
- Text that ends inside a UTF-8 character when generation ends is not shown (vLLM's
  detokenizer never emits it either).
- On a match the text is cut just before the stop string; the token that completed it counts
  as generated (usage, `finish_reason: "stop"`), as in vLLM.
- Streaming holds back the last `max(len(stop)) - 1` characters until more text shows they
  cannot start a stop string (or generation ended).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]  # token ids -> text, special tokens skipped


class Detokenizer:
    """Incremental text of a token sequence (the prefix-offset method vLLM uses for slow
    tokenizers): each `push` decodes only the last few tokens."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] is text already emitted, context for the next token
        self._read = 0

    def push(self, token: int) -> str:
        """Append `token`; returns the text it adds ("" while a character is incomplete)."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += new
            return new
        return ""


class TextStops:
    """The output text of one generation and its stop strings.

    `push(token)` -> the stop string the token completed (the text is cut before it), or None.
    `visible(finished)` -> the text a stream may show now."""

    def __init__(self, decode: Decode, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.detok = Detokenizer(decode)
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.text = ""
        self.stopped: str | None = None
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.detok.ids)

    def push(self, token: int) -> str | None:
        if self.stopped is not None:
            raise ValueError("generation already ended at a stop string")
        new = self.detok.push(token)
        self.text += new
        if not self.stop or not new or self.num_tokens <= self.min_tokens:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop): the one completing first wins
        for stop in self.stop:
            # only where the new text could end it: vLLM's find(stop, 1 - new_chars - len(stop))
            at = self.text.find(stop, max(0, len(self.text) - len(new) - len(stop) + 1))
            if at != -1 and (best is None or at + len(stop) < best[0]):
                best = (at + len(stop), at, stop)
        if best is None:
            return None
        self.text, self.stopped = self.text[: best[1]], best[2]
        return best[2]

    def visible(self, finished: bool) -> str:
        if finished or self.stopped is not None or not self._hold:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]


def output_text(decode: Decode, token_ids: Sequence[int]) -> str:
    """The text a response shows for `token_ids` (no stop strings): decoded incrementally, so a
    character left incomplete at the end is not shown."""
    detok = Detokenizer(decode)
    for token in token_ids:
        detok.push(token)
    return detok.text
