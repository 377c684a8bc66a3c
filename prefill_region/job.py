"""One admitted prefill job as the agent tracks it: its events for the caller, its cancel and
deadline. It is the `JobProgress` its backend reports to (`backend.py`).

A job ends exactly once: the first error given to `cancel` is the job's error; every later
one is ignored. Whatever the backend attached (a transfer, a vLLM request) is canceled with it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prfaas.engine.sampling import Chosen
from prfaas.prefill_region.backend import JobStopped, PrefillWork
from prfaas.protos.prfaas.v1 import common_pb2, prefill_pb2
from prfaas.region.errors import DeadlineExceeded
from prfaas.region.requests import firsts_to_proto, logprobs_to_proto, prompt_logprobs_to_proto

END = object()  # the last item of `events`: the job ended (its `error` says how)


@dataclass(eq=False)
class Job:
    work: PrefillWork
    on_prefilled: Callable[[int, float], None]  # (tokens computed, seconds): the region's throughput
    started: float = field(default_factory=time.monotonic)
    events: queue.Queue[object] = field(default_factory=queue.Queue)  # PrefillEvent ..., then END
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    running: bool = False  # a worker took it (the agent's lock guards it)
    _cancels: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def job_id(self) -> str:
        return self.work.job_id

    @property
    def deadline(self) -> float:
        return self.work.deadline

    def emit(self, event: prefill_pb2.PrefillEvent) -> None:
        event.elapsed_s = time.monotonic() - self.started
        self.events.put(event)

    def cancel(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            cancels = list(self._cancels)
        self.stop.set()
        for cancel in cancels:
            cancel()

    def attach(self, cancel: Callable[[], None]) -> None:
        with self._lock:
            self._cancels.append(cancel)
        if self.stop.is_set():
            cancel()
            raise JobStopped

    def check(self) -> None:
        if self.stop.is_set():
            raise JobStopped
        if time.monotonic() >= self.work.deadline:
            self.cancel(DeadlineExceeded("prefill job deadline reached"))
            raise JobStopped

    def layer_shipped(self, index: int) -> None:
        self.emit(prefill_pb2.PrefillEvent(layer_shipped=prefill_pb2.LayerShipped(layer=index)))

    def prefill_done(
        self, firsts: Sequence[Chosen], kv: common_pb2.KVDescriptor, prefill_s: float, cached_tokens: int = 0
    ) -> None:
        self.on_prefilled(len(self.work.token_ids) - cached_tokens, prefill_s)
        first = firsts[0]
        done = prefill_pb2.PrefillDone(
            first_token=first.token,
            kv=kv,
            prefill_s=prefill_s,
            first_logprobs=logprobs_to_proto(first.logprobs),
            choices=firsts_to_proto(firsts),
            prompt_logprobs=prompt_logprobs_to_proto(first),
            cached_tokens=cached_tokens,
        )
        self.emit(prefill_pb2.PrefillEvent(prefill_done=done))
