"""Split generation across two OS processes: prefill in one, decode in the other.

The KV cache crosses the process boundary only as bytes (`kv_to_bytes`), exactly as it
will cross regions. Used by `prfaas demo` and by the tests that prove a split run gives
the colocated tokens. Each worker loads the model once and keeps it for later calls.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from prfaas.engine.errors import WorkerTimeout
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.serialize import kv_from_bytes, kv_to_bytes

T = TypeVar("T")

# Per worker process: the engines it has loaded, by (model, dtype).
_engines: dict[tuple[str, str], HFEngine] = {}


def _engine(model: str, dtype: str) -> HFEngine:
    key = (model, dtype)
    if key not in _engines:
        _engines[key] = HFEngine(model, dtype=dtype)
    return _engines[key]


@dataclass(frozen=True)
class PrefillOutput:
    kv_bytes: bytes
    first_token: int  # choice 0's
    prefill_s: float  # model forward over the prompt, excluding model load and serialization
    pid: int
    first_tokens: tuple[int, ...] = ()  # every choice's (params.n of them; choice 0's first)


@dataclass(frozen=True)
class DecodeOutput:
    tokens: list[int]  # steps 1.. (without the first token)
    last_logits: np.ndarray  # [vocab] float32 of the last step, or of nothing if no step ran
    decode_s: float
    pid: int


@dataclass(frozen=True)
class SplitResult:
    tokens: list[int]  # all generated tokens of choice 0, first one included
    last_logits: np.ndarray  # choice 0's
    prefill_s: float
    decode_ms_per_token: float  # over every choice's decoded tokens
    kv_bytes: int
    prefill_pid: int
    decode_pid: int
    choices: tuple[list[int], ...] = ()  # every choice's tokens (params.n of them; choice 0's is `tokens`)


def _prefill_job(model: str, dtype: str, token_ids: list[int], params: SamplingParams) -> PrefillOutput:
    engine = _engine(model, dtype)
    start = time.perf_counter()
    result = engine.prefill(token_ids, params)
    elapsed = time.perf_counter() - start
    firsts = tuple(first.token for first in result.choices)
    return PrefillOutput(kv_to_bytes(result.kv), result.first_token, elapsed, os.getpid(), firsts)


def _decode_job(model: str, dtype: str, kv_bytes: bytes, first_token: int, params: SamplingParams,
                prompt_ids: list[int]) -> DecodeOutput:  # fmt: skip
    engine = _engine(model, dtype)
    kv = kv_from_bytes(kv_bytes)
    start = time.perf_counter()
    tokens, logits = [], np.zeros(0, dtype=np.float32)
    for step in engine.decode_steps(kv, first_token, params, prompt_ids):
        tokens.append(step.token)
        logits = step.logits.numpy()
    return DecodeOutput(tokens, logits, time.perf_counter() - start, os.getpid())


def _warm_job(model: str, dtype: str) -> int:
    _engine(model, dtype)
    return os.getpid()


class SplitRunner:
    """Two worker processes, one for prefill and one for decode, each holding `model`.

    Every call waits at most `timeout_s` (model load included on the first call) and
    raises `WorkerTimeout` past it. Errors raised in a worker (bad KV, wrong model) are
    re-raised here with their own type. Close it (or use `with`) to stop both workers.
    """

    def __init__(self, model: str | Path, *, dtype: str = "float32", timeout_s: float = 600.0) -> None:
        self.model = str(model)
        self.dtype = dtype
        self.timeout_s = timeout_s
        context = multiprocessing.get_context("spawn")  # no forked torch thread pools
        self._prefill = ProcessPoolExecutor(max_workers=1, mp_context=context)
        self._decode = ProcessPoolExecutor(max_workers=1, mp_context=context)

    def _wait(self, future: Future[T], what: str) -> T:
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            future.cancel()
            raise WorkerTimeout(f"{what} worker did not answer within {self.timeout_s:.0f} s") from None

    def warm_up(self) -> None:
        """Load the model in both workers (in parallel) so later timings exclude loading."""
        futures = [pool.submit(_warm_job, self.model, self.dtype) for pool in (self._prefill, self._decode)]
        for future, what in zip(futures, ("prefill", "decode"), strict=True):
            self._wait(future, what)

    def prefill(self, token_ids: Sequence[int], params: SamplingParams) -> PrefillOutput:
        future = self._prefill.submit(_prefill_job, self.model, self.dtype, list(token_ids), params)
        return self._wait(future, "prefill")

    def decode(self, kv_bytes: bytes, first_token: int, params: SamplingParams,
               prompt_ids: Sequence[int] = ()) -> DecodeOutput:  # fmt: skip
        """One choice's steps 1..; `params` is that choice's (`SamplingParams.for_choice`). `prompt_ids` (the
        prompt the KV covers) are needed only for `repetition_penalty`, as for `Engine.decode`."""
        future = self._decode.submit(_decode_job, self.model, self.dtype, kv_bytes, first_token, params,
                                     list(prompt_ids))  # fmt: skip
        return self._wait(future, "decode")

    def run(self, token_ids: Sequence[int], params: SamplingParams) -> SplitResult:
        """Prefill once, then decode each of the `params.n` choices from that one KV, as the regions do."""
        pre = self.prefill(token_ids, params)
        firsts = pre.first_tokens or (pre.first_token,)
        decs = [self.decode(pre.kv_bytes, first, params.for_choice(c), token_ids) for c, first in enumerate(firsts)]
        steps = max(sum(len(dec.tokens) for dec in decs), 1)
        choices = tuple([first, *dec.tokens] for first, dec in zip(firsts, decs, strict=True))
        return SplitResult(
            tokens=choices[0],
            last_logits=decs[0].last_logits,
            prefill_s=pre.prefill_s,
            decode_ms_per_token=1000.0 * sum(dec.decode_s for dec in decs) / steps,
            kv_bytes=len(pre.kv_bytes),
            prefill_pid=pre.pid,
            decode_pid=decs[0].pid,
            choices=choices,
        )

    def close(self, grace_s: float = 5.0) -> None:
        """Stop both workers: let them exit within `grace_s`, then terminate them."""
        processes = []
        for pool in (self._prefill, self._decode):
            # ProcessPoolExecutor has no public handle on its workers before Python 3.14.
            processes += list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + grace_s
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()  # stuck in a long forward: it must not outlive us
                process.join(timeout=grace_s)

    def __enter__(self) -> SplitRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
