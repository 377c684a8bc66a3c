"""The decode agent of a region with `engine: vllm`: the same gRPC surface, reservations,
admission, tombstones, peer watch and deadlines as the HF agent (it is one); the KV lands
in the region's vLLM server instead of the agent.

- Reserve registers the shipment with the server (`expect`) before the prefill starts;
  the KV endpoint it returns is the server's KV port (the prfaas connector receives there,
  in the wire format the HF agent receives, so either engine's prefill can feed it).
- Decode sends vLLM `prompt + [first_token]` with the shipment covering the prompt
  (`LoadParams.num_tokens`): vLLM computes only the first token's position and streams
  the rest; tokens equal a single vLLM process's. A shipment that fails or misses its
  deadline is recomputed by vLLM (late, not wrong). DecodeRequest.token_ids is required.
- Generate runs the prompt whole in vLLM.
Decoding is greedy (the host's only mode); sampling requests get INVALID_ARGUMENT.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from prfaas.decode_region.agent import MAX_TIMEOUT_S, DecodeAgent, Reservation
from prfaas.engine.errors import InvalidPrompt, PromptTooLong
from prfaas.engine.kv import hash_token_ids
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.vllm_params import LoadParams
from prfaas.engine.vllm_remote import VLLMEngine, check_greedy
from prfaas.engine.vllm_server import StreamStopped
from prfaas.protos.prfaas.v1 import decode_pb2
from prfaas.protos.rpc import Canceled, InvalidRequest, RegionError, streaming


class VLLMDecodeAgent(DecodeAgent):
    def __init__(self, engine: VLLMEngine, **options: Any) -> None:
        self.vllm = engine
        if engine.kv_endpoint is None:
            raise ValueError("a vLLM decode region's server needs ticket keys (it receives the KV)")
        super().__init__(engine, None, kv_endpoint=engine.kv_endpoint, **options)  # type: ignore[arg-type]

    # -- reservations: the server holds the shipment ------------------------------------------

    def _expect_shipment(self, res: Reservation, ttl_s: float) -> None:
        self.vllm.expect(res.job_id, res.attempt, ttl_s)

    def _start_assembly(self, res: Reservation) -> None:
        pass  # vLLM's connector fills its paged blocks as the layers arrive

    def _end(self, res: Reservation, error: BaseException | None) -> None:
        first = not res.ended
        super()._end(res, error)
        if first and not res.decoding:  # no vLLM request will take the shipment: drop it there
            with contextlib.suppress(Exception):  # the server is gone or slow: the registration expires
                self.vllm.forget(res.job_id, res.attempt)

    # -- decode ----------------------------------------------------------------------------

    def _check_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        check_greedy(params)
        if not token_ids:
            raise InvalidPrompt("prompt is empty; at least one token is required")
        bad = next((t for t in token_ids if t >= self.vllm.vocab_size), None)
        if bad is not None:
            raise InvalidPrompt(f"token id {bad} is outside the vocabulary [0, {self.vllm.vocab_size})")
        if len(token_ids) + params.max_new_tokens > self.vllm.max_context:
            raise PromptTooLong(
                f"prompt of {len(token_ids)} tokens plus max_new_tokens {params.max_new_tokens} exceeds "
                f"the model's context of {self.vllm.max_context} tokens"
            )

    @streaming
    def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.TokenEvent]:
        desc = request.kv
        prompt = list(request.token_ids)

        def check(params: SamplingParams) -> None:
            if not prompt:
                raise InvalidRequest("token_ids is empty: a vLLM decode region needs the prompt the KV belongs to")
            if len(prompt) != desc.num_tokens:
                raise InvalidRequest(f"token_ids holds {len(prompt)} tokens, the KV covers {desc.num_tokens}")
            if desc.token_ids_hash and hash_token_ids(prompt) != desc.token_ids_hash:
                raise InvalidRequest("token_ids do not match the KV's token_ids_hash (another prompt's cache)")
            self._check_prompt(prompt, params)

        job_id, params, started, deadline, res = self._begin_decode(request, context, check)
        rest: Iterator[int] = iter(())
        try:
            with self._worker(deadline):
                remaining = deadline - time.monotonic()
                load = LoadParams(job_id, request.attempt, min(MAX_TIMEOUT_S, max(0.1, remaining)), len(prompt))
                if params.max_new_tokens > 1:  # vLLM generates at least one token
                    rest = self.vllm.stream([*prompt, request.first_token], params.max_new_tokens - 1,
                                            load.to_kv_params(), remaining, stop=res.canceled)  # fmt: skip
                tokens = _stop_watch_at_first(res, rest)
                yield from self._tokens(request.first_token, tokens, params, res.canceled, deadline, started, "split")
        except Exception as exc:
            self._end(res, exc)
            if res.error is not exc and isinstance(res.error, RegionError):
                raise res.error from None  # e.g. Cancel won the race: CANCELLED, not a side effect
            raise
        except BaseException:  # GeneratorExit: the caller went away
            self._end(res, Canceled("the caller disconnected"))
            raise
        finally:
            close = getattr(rest, "close", None)
            if close is not None:
                close()  # an early end (EOS, cancel, deadline) aborts the vLLM request
        self._end(res, None)

    @streaming
    def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.TokenEvent]:
        job_id, params, started, deadline, token_ids, canceled = self._begin_generate(
            request, context, self._check_prompt
        )
        tokens: Iterator[int] = iter(())
        try:
            with self._worker(deadline):
                tokens = self.vllm.stream(
                    token_ids, params.max_new_tokens, None, deadline - time.monotonic(), stop=canceled
                )
                yield from self._tokens(next(tokens), tokens, params, canceled, deadline, started, "local")
        except StreamStopped:
            raise Canceled("canceled during decode") from None
        finally:
            close = getattr(tokens, "close", None)
            if close is not None:
                close()
            self._stop_local(job_id)

    def close(self) -> None:
        super().close()
        self.vllm.close()


def _stop_watch_at_first(res: Reservation, tokens: Iterator[int]) -> Iterator[int]:
    """Once vLLM produced a token the prompt's KV is in (loaded, or recomputed): the
    prefill region owes nothing more, and losing it must not end this decode."""
    for index, token in enumerate(tokens):
        if index == 0 and res.watch is not None:
            res.watch.stop()
        yield token
