"""`FirstOutputPenalties`: the vLLM logits processor that makes a split job's decode request
penalize its first token as one vLLM request would (vLLM environment only).

The decode request's prompt ends with the token the prefill region chose (step 0). vLLM's
presence and frequency penalties count output tokens only, so that token would go
unpenalized; the request names it in `extra_args[FIRST_OUTPUT_KEY]` (engine/vllm/sampling.py)
and this processor lowers its logit by its share: `frequency + presence` while it has not
been generated again, `frequency` after (presence counts once).

vLLM runs this processor before its penalties, and repetition penalty (which already covers
the token: it is in the prompt) divides positive logits and multiplies negative ones after
it. The shift is therefore applied through that scaling's inverse: with `s` the scaling, the
logit becomes `s⁻¹(s(x) - shift)`, so that after vLLM's penalties it is `s(x) - shift`, what
one request computes (equal up to float rounding; exact when repetition_penalty is 1).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from prfaas.engine.vllm.sampling import FIRST_OUTPUT_KEY

FQCN = f"{__name__}:FirstOutputPenalties"


class FirstOutputPenalties(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (first token, presence, frequency, repetition, the request's live output ids)
        self.rows: dict[int, tuple[int, float, float, float, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is the most likely

    @staticmethod
    def _entry(
        params: SamplingParams, _prompt: list[int] | None, output: list[int]
    ) -> tuple[int, float, float, float, list[int]] | None:
        first = (params.extra_args or {}).get(FIRST_OUTPUT_KEY)
        if first is None or not (params.presence_penalty or params.frequency_penalty):
            return None
        return int(first), params.presence_penalty, params.frequency_penalty, params.repetition_penalty, output

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._entry)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (token, presence, frequency, repetition, output) in self.rows.items():
            shift = frequency + (presence if token not in output else 0.0)
            value = float(logits[row, token])
            scaled = value / repetition if value > 0 else value * repetition
            target = scaled - shift
            logits[row, token] = target * repetition if target > 0 else target / repetition
        return logits
