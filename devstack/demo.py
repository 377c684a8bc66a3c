"""`prfaas demo` (`make demo-split`): one prompt generated colocated and split across two
processes (engine/split.py: prefill in one, the KV as bytes, decode in the other), compared."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.split import SplitRunner

DEFAULT_PROMPT = (
    "Context: Large language model serving has two phases. Prefill reads the whole prompt at once and is "
    "limited by compute; decode produces one token at a time and is limited by memory bandwidth. Running "
    "both on the same GPU lets long prompts stall every other request's decoding. Prefill-as-a-Service "
    "runs the prefill of long prompts in a region where compute is cheap, ships the resulting key-value "
    "cache over the network, and decodes in the region that serves the user.\n\n"
    "Question: Why is it useful to run prefill and decode in different places? Answer in two sentences."
)


@dataclass(frozen=True)
class DemoReport:
    model: str
    prompt_tokens: int
    colocated_text: str
    split_text: str
    identical: bool
    colocated_prefill_s: float
    colocated_decode_ms_per_token: float
    split_prefill_s: float
    split_decode_ms_per_token: float
    kv_bytes: int
    kv_bytes_per_token: int
    prefill_pid: int
    decode_pid: int


def run_demo(model: str, prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 48) -> DemoReport:
    """Generate greedily twice (fp32): colocated in this process, then split in two workers."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engine = HFEngine(model)
    token_ids = engine.encode(prompt, chat=True)

    start = time.perf_counter()
    pre = engine.prefill(token_ids, params)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    rest = list(engine.decode(pre.kv, pre.first_token, params))
    decode_ms = 1000.0 * (time.perf_counter() - start) / max(len(rest), 1)
    colocated = [pre.first_token, *rest]

    with SplitRunner(model) as runner:
        runner.warm_up()
        split = runner.run(token_ids, params)

    return DemoReport(
        model=model,
        prompt_tokens=len(token_ids),
        colocated_text=engine.decode_text(colocated),
        split_text=engine.decode_text(split.tokens),
        identical=split.tokens == colocated,
        colocated_prefill_s=prefill_s,
        colocated_decode_ms_per_token=decode_ms,
        split_prefill_s=split.prefill_s,
        split_decode_ms_per_token=split.decode_ms_per_token,
        kv_bytes=split.kv_bytes,
        kv_bytes_per_token=pre.kv.bytes_per_token,
        prefill_pid=split.prefill_pid,
        decode_pid=split.decode_pid,
    )
