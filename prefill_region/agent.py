"""The prefill region agent: a bounded job queue in front of the engine workers; each job
runs prefill and ships every layer's KV to the decode region named in the request as soon
as the layer is computed; events stream back to the caller. Finished KV is leased for a
short while so `Reship` can send it to another decode region without recomputing.

A job ends exactly once (`_Job.finish`): done, failed (transfer error, deadline) or
canceled (Cancel RPC, caller gone). Cancel stops compute at the next layer boundary and
cancels the transfer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from prfaas.engine.base import PrefillResult
from prfaas.engine.hf import HFEngine
from prfaas.prefill_region import metrics
from prfaas.prefill_region.layer_tap import LayerTap, byte_view
from prfaas.prefill_region.shipping import ChannelPool, Destination, ship_spec, wait_transfer
from prfaas.protos.prfaas.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from prfaas.protos.rpc import (
    Canceled,
    Conflict,
    DeadlineExceeded,
    Exhausted,
    InvalidRequest,
    NotFound,
    Unavailable,
    job_uuid,
    sampling_from_proto,
    streaming,
    timeout_from,
    unary,
)
from prfaas.transport.api import Shipment, Transfer, TransferStatus

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0
_END = object()


class _Stop(Exception):
    """Raised inside the forward (from a layer hook) to abort a canceled job's compute."""


@dataclass(eq=False)
class _Job:
    job_id: str
    attempt: int
    token_ids: list[int]
    request: prefill_pb2.PrefillRequest
    destination: Destination
    deadline: float
    started: float = field(default_factory=time.monotonic)
    events: queue.Queue[object] = field(default_factory=queue.Queue)
    stop: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    transfer: Transfer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, **event: object) -> None:
        self.events.put(prefill_pb2.PrefillEvent(elapsed_s=time.monotonic() - self.started, **event))  # type: ignore[arg-type]

    def cancel(self, error: Exception) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            transfer = self.transfer
        self.stop.set()
        if transfer is not None:
            transfer.cancel()


@dataclass(eq=False)
class _Lease:
    result: PrefillResult
    expires: float
    shipping: int = 0  # live re-shipments: the KV stays until they end


class PrefillAgent(prefill_pb2_grpc.PrefillRegionServicer):
    def __init__(
        self,
        engine: HFEngine,
        *,
        num_workers: int = 1,
        queue_depth: int = 8,
        codec: str = "lossless",
        kv_lease_s: float = 30.0,
        kv_lease_bytes: int = 2 << 30,
        node: str = "prefill",
        test_layer_delay_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.num_workers = num_workers
        self.queue_depth = queue_depth
        self.codec = codec
        self.kv_lease_s = kv_lease_s
        self.kv_lease_bytes = kv_lease_bytes  # leases past this are dropped, oldest first
        self.test_layer_delay_s = test_layer_delay_s  # TEST ONLY: a slow prefill for fault tests
        self.tap = self._layer_tap()
        self.channels = ChannelPool(node)
        self.draining = False
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="prfaas-prefill")
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._leases: dict[str, _Lease] = {}
        self._busy = 0
        self._rate = 0.0  # prompt tokens/s, smoothed
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="prfaas-prefill-leases", daemon=True)
        self._reaper.start()

    def _layer_tap(self) -> LayerTap | None:
        """Forward hooks on the HF model (None: the engine ships its layers itself)."""
        return LayerTap(self.engine.model)

    # -- admission -------------------------------------------------------------------------

    def _validate(self, request: prefill_pb2.PrefillRequest) -> tuple[list[int], Destination]:
        token_ids = list(request.token_ids)
        params = sampling_from_proto(request.sampling)
        if not token_ids:
            raise InvalidRequest("token_ids is empty; at least one token is required")
        bad = next((t for t in token_ids if t >= self.engine.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {self.engine.vocab_size})")
        if len(token_ids) + params.max_new_tokens > self.engine.max_context:
            raise InvalidRequest(
                f"prompt of {len(token_ids)} tokens plus max_new_tokens {params.max_new_tokens} exceeds "
                f"the model's context of {self.engine.max_context} tokens"
            )
        return token_ids, Destination.parse(request.destination, self.codec)

    @streaming
    def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> Iterator[prefill_pb2.PrefillEvent]:
        job_id = job_uuid(request.job_id)
        timeout_s = timeout_from(request.timeout_s, default_s=DEFAULT_TIMEOUT_S, max_s=MAX_TIMEOUT_S)
        token_ids, destination = self._validate(request)
        job = _Job(job_id, request.attempt, token_ids, request, destination, time.monotonic() + timeout_s)
        with self._lock:
            if self.draining:
                metrics.REJECTED.labels("draining").inc()
                raise Unavailable("prefill region is draining; send the job elsewhere")
            if job_id in self._jobs:
                raise Conflict(f"job {job_id} is already queued or running here")
            if len(self._jobs) >= self.num_workers + self.queue_depth:
                metrics.REJECTED.labels("queue_full").inc()
                raise Exhausted(
                    f"prefill queue full: {len(self._jobs) - self._busy} queued (limit {self.queue_depth}), "
                    f"{self._busy} of {self.num_workers} workers busy"
                )
            self._jobs[job_id] = job
        self._gauges()
        context.add_callback(lambda: job.cancel(Canceled("the caller disconnected")))
        self._pool.submit(self._run, job)
        ended = False
        try:
            while True:
                try:
                    item = job.events.get(timeout=0.25)
                except queue.Empty:
                    if time.monotonic() > job.deadline + 5.0:  # the worker enforces the deadline; this is a backstop
                        job.cancel(DeadlineExceeded("prefill job deadline reached"))
                    continue
                if item is _END:
                    ended = True
                    if job.error is not None:
                        raise job.error
                    return
                assert isinstance(item, prefill_pb2.PrefillEvent)
                yield item
        finally:
            if not ended:
                job.cancel(Canceled("the caller disconnected"))

    # -- the job ---------------------------------------------------------------------------

    def _run(self, job: _Job) -> None:
        try:
            with self._lock:
                self._busy += 1
            self._gauges()
            self._prefill_and_ship(job)
        except _Stop:
            pass  # job.error says why
        except Exception as exc:
            job.cancel(exc)  # records the first error; stops the transfer
        finally:
            with self._lock:
                self._busy -= 1
                self._jobs.pop(job.job_id, None)
            self._gauges()
            outcome = "done" if job.error is None else type(job.error).__name__
            metrics.JOBS.labels(outcome).inc()
            job.events.put(_END)

    def _check(self, job: _Job) -> None:
        if job.stop.is_set():
            raise _Stop
        if time.monotonic() >= job.deadline:
            job.cancel(DeadlineExceeded("prefill job deadline reached"))
            raise _Stop

    def _prefill_and_ship(self, job: _Job) -> None:
        job.emit(started=prefill_pb2.Started(queued_s=time.monotonic() - job.started))
        self._check(job)
        params = sampling_from_proto(job.request.sampling)
        engine, tap = self.engine, self.tap
        assert tap is not None  # the HF engine's agent
        shape = (engine.num_kv_heads, len(job.token_ids), engine.head_dim)
        spec = ship_spec(job.job_id, job.attempt, job.destination, engine.dtype, (shape,) * tap.num_layers,
                         job.deadline - time.monotonic())  # fmt: skip
        shipment = Shipment(spec)
        transfer = self.channels.get(job.destination.address).submit(shipment)
        with job._lock:
            job.transfer = transfer
        if job.stop.is_set():
            transfer.cancel()
            raise _Stop
        whole = job.request.ship_whole

        def on_layer(index: int, k: object, v: object) -> None:
            if self.test_layer_delay_s:  # TEST ONLY (RegionConfig.test_layer_delay_s); a cancel cuts it short
                job.stop.wait(self.test_layer_delay_s)
            self._check(job)
            if transfer.status() in (TransferStatus.FAILED, TransferStatus.TIMEOUT, TransferStatus.CANCELED):
                raise _Stop  # e.g. the ticket was refused: computing on is wasted work
            if not whole:
                shipment.add_layer(index, byte_view(k), byte_view(v))  # type: ignore[arg-type]
                job.emit(layer_shipped=prefill_pb2.LayerShipped(layer=index))

        t0 = time.monotonic()
        try:
            with tap.tapping(on_layer):
                result = engine.prefill(job.token_ids, params)
        except _Stop:
            self._transfer_failed(job, transfer)
            raise
        prefill_s = time.monotonic() - t0
        self._count_tokens(len(job.token_ids), prefill_s)
        self._lease(job.job_id, result)
        if whole:
            for index, layer in enumerate(result.kv.layers):
                shipment.add_layer(index, byte_view(layer.k), byte_view(layer.v))
                job.emit(layer_shipped=prefill_pb2.LayerShipped(layer=index))
        job.emit(prefill_done=prefill_pb2.PrefillDone(first_token=result.first_token, kv=_descriptor(result),
                                                      prefill_s=prefill_s))  # fmt: skip
        status = wait_transfer(transfer, job.deadline, job.stop, kind="prefill")
        if status is not TransferStatus.COMPLETED:
            self._transfer_failed(job, transfer)
            raise _Stop
        job.emit(shipment_complete=_complete(transfer))

    def _transfer_failed(self, job: _Job, transfer: Transfer) -> None:
        error = transfer.error
        if job.error is None and error is not None and transfer.status() is not TransferStatus.CANCELED:
            job.cancel(error)
        elif job.error is None:
            job.cancel(error or Canceled("KV transfer ended early"))
        transfer.cancel()

    def _lease(self, job_id: str, result: PrefillResult) -> None:
        """Keep `result` for Reship; the oldest idle leases go when their bytes pass the cap."""
        with self._lock:
            self._leases[job_id] = _Lease(result, time.monotonic() + self.kv_lease_s)
            total = sum(lease.result.kv.nbytes for lease in self._leases.values())
            for old_id, old in list(self._leases.items()):  # insertion order: oldest first
                if total <= self.kv_lease_bytes:
                    break
                if old_id != job_id and not old.shipping:
                    del self._leases[old_id]
                    total -= old.result.kv.nbytes
            num_leases = len(self._leases)
        metrics.LEASES.set(num_leases)

    def _count_tokens(self, num_tokens: int, seconds: float) -> None:
        metrics.TOKENS.inc(num_tokens)
        rate = num_tokens / max(seconds, 1e-6)
        self._rate = rate if self._rate == 0 else 0.8 * self._rate + 0.2 * rate
        metrics.TOKENS_PER_S.set(self._rate)

    # -- re-shipment and cancel ------------------------------------------------------------

    @unary
    def Reship(self, request: prefill_pb2.ReshipRequest, context: grpc.ServicerContext) -> prefill_pb2.ReshipReply:
        job_id = job_uuid(request.job_id)
        timeout_s = timeout_from(request.timeout_s, default_s=DEFAULT_TIMEOUT_S, max_s=MAX_TIMEOUT_S)
        destination = Destination.parse(request.destination, self.codec)
        with self._lock:
            lease = self._leases.get(job_id)
            if lease is None:
                raise NotFound(
                    f"no KV lease for job {job_id}: never prefilled here, or kept past {self.kv_lease_s:g} s"
                )
            lease.shipping += 1
        try:
            kv = lease.result.kv
            shapes = tuple(tuple(layer.k.shape) for layer in kv.layers)
            deadline = time.monotonic() + timeout_s
            spec = ship_spec(job_id, request.attempt, destination, kv.dtype, shapes, timeout_s)  # type: ignore[arg-type]
            shipment = Shipment(spec)
            transfer = self.channels.get(destination.address).submit(shipment)
            context.add_callback(transfer.cancel)
            for index, layer in enumerate(kv.layers):
                shipment.add_layer(index, byte_view(layer.k), byte_view(layer.v))
            status = wait_transfer(transfer, deadline, threading.Event(), kind="reship")
            if status is not TransferStatus.COMPLETED:
                raise transfer.error or DeadlineExceeded("re-shipment did not complete")
            return prefill_pb2.ReshipReply(
                shipment=_complete(transfer), kv=_descriptor(lease.result), first_token=lease.result.first_token
            )
        finally:
            with self._lock:
                lease.shipping -= 1

    @unary
    def Cancel(self, request: common_pb2.CancelRequest, context: grpc.ServicerContext) -> common_pb2.CancelReply:
        job_id = job_uuid(request.job_id)
        with self._lock:
            job = self._jobs.get(job_id)
            lease = self._leases.pop(job_id, None)
        if job is not None:
            job.cancel(Canceled(f"canceled: {request.reason or 'by the caller'}"))
        metrics.LEASES.set(len(self._leases))
        return common_pb2.CancelReply(found=job is not None or lease is not None)

    def _reap_loop(self) -> None:
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._lock:
                for job_id in [j for j, lease in self._leases.items() if lease.expires <= now and not lease.shipping]:
                    del self._leases[job_id]
                num_leases = len(self._leases)
            metrics.LEASES.set(num_leases)

    # -- region ----------------------------------------------------------------------------

    def _gauges(self) -> None:
        with self._lock:
            busy, queued = self._busy, len(self._jobs) - self._busy
        metrics.BUSY_WORKERS.set(busy)
        metrics.QUEUE_DEPTH.set(queued)

    def load(self) -> dict[str, float]:
        with self._lock:
            busy, queued = self._busy, len(self._jobs) - self._busy
        return {"queue_depth": queued, "busy_workers": busy, "prefill_tokens_per_s": self._rate}

    def idle(self) -> bool:
        with self._lock:
            return not self._jobs

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel(Unavailable("prefill region shutting down"))
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.channels.close()


def _descriptor(result: PrefillResult) -> common_pb2.KVDescriptor:
    kv = result.kv
    return common_pb2.KVDescriptor(
        model_fingerprint=kv.model_fingerprint, dtype=kv.dtype, num_tokens=kv.num_tokens,
        token_ids_hash=kv.token_ids_hash,
    )  # fmt: skip


def _complete(transfer: Transfer) -> prefill_pb2.ShipmentComplete:
    stats = transfer.stats
    return prefill_pb2.ShipmentComplete(
        raw_bytes=stats.raw_bytes, wire_bytes=stats.wire_bytes, transfer_s=stats.seconds
    )
