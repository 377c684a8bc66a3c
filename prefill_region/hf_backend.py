"""`HFPrefill`: the prefill backend of a region with `engine: hf` (the embedded engine).

Each decoder layer's KV is handed to the transport as soon as it is computed (the engine's
`on_layer`: right after the layer writes its K/V into the cache, before its attention and MLP
run), over one pooled channel per decode region (`shipping.ChannelPool`). A finished job's KV
is leased for a short while (`Leases`) so `reship` can send it to another decode region
without recomputing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prfaas.engine.base import ModelFacts, PrefillResult
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.staging import StagedShipment, device_copier, feed_layer
from prfaas.prefill_region import metrics
from prfaas.prefill_region.backend import JobProgress, JobStopped, PrefillWork, Reshipped, Shipped, kv_descriptor
from prfaas.prefill_region.destination import Destination
from prfaas.prefill_region.shipping import ChannelPool, ship_spec, wait_transfer
from prfaas.protos.prfaas.v1 import common_pb2
from prfaas.region.errors import Canceled, DeadlineExceeded, NotFound
from prfaas.region.requests import stops
from prfaas.transport.api import Shipment, Transfer, TransferStatus
from prfaas.transport.pathmeter import PathReport


@dataclass(eq=False)
class _Lease:
    result: PrefillResult
    expires: float  # time.monotonic()
    attempt: int  # the job's attempt that computed it
    shipping: int = 0  # live re-shipments: the KV stays until they end


class Leases:
    """Finished KV kept `lease_s` seconds for re-shipment, at most `max_bytes` in all (the
    oldest idle leases go first). A reaper thread drops expired ones until `close()`."""

    def __init__(self, lease_s: float, max_bytes: int) -> None:
        self.lease_s = lease_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}  # insertion order: oldest first
        self._closed = threading.Event()
        threading.Thread(target=self._reap_loop, name="prfaas-prefill-leases", daemon=True).start()

    def job_ids(self) -> list[str]:
        """The jobs whose KV is kept, oldest first."""
        with self._lock:
            return list(self._leases)

    def put(self, job_id: str, result: PrefillResult, attempt: int = 0) -> None:
        with self._lock:
            self._leases[job_id] = _Lease(result, time.monotonic() + self.lease_s, attempt)
            total = sum(lease.result.kv.nbytes for lease in self._leases.values())
            for old_id, old in list(self._leases.items()):
                if total <= self.max_bytes:
                    break
                if old_id != job_id and not old.shipping:
                    del self._leases[old_id]
                    total -= old.result.kv.nbytes
            metrics.LEASES.set(len(self._leases))

    def hold(self, job_id: str) -> _Lease:
        """The lease of `job_id`, kept until `unhold`; NotFound when there is none."""
        with self._lock:
            lease = self._leases.get(job_id)
            if lease is None:
                raise NotFound(f"no KV lease for job {job_id}: never prefilled here, or kept past {self.lease_s:g} s")
            lease.shipping += 1
            return lease

    def unhold(self, lease: _Lease) -> None:
        with self._lock:
            lease.shipping -= 1

    def drop(self, job_id: str, attempt: int = 0) -> bool:
        """Forget `job_id`'s lease if `attempt` (0: any) or a newer one made it; whether one was dropped."""
        with self._lock:
            lease = self._leases.get(job_id)
            found = lease is not None and stops(attempt, lease.attempt)
            if found:
                del self._leases[job_id]
            metrics.LEASES.set(len(self._leases))
        return found

    def _reap_loop(self) -> None:
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._lock:
                for job_id in [j for j, lease in self._leases.items() if lease.expires <= now and not lease.shipping]:
                    del self._leases[job_id]
                metrics.LEASES.set(len(self._leases))

    def close(self) -> None:
        self._closed.set()


class HFPrefill:
    """`channels` carries the KV (its node name, and the control plane for WebRTC signalling);
    `test_layer_delay_s` (TEST ONLY, RegionConfig.test_layer_delay_s) slows each layer so fault
    tests can act mid-prefill."""

    def __init__(
        self,
        engine: HFEngine,
        channels: ChannelPool,
        *,
        kv_lease_s: float = 30.0,
        kv_lease_bytes: int = 2 << 30,
        test_layer_delay_s: float = 0.0,
        staging_bytes: int = 2 << 30,
    ) -> None:
        self.engine = engine
        # on a GPU each layer leaves device memory on a side stream into pinned buffers (engine/staging.py)
        self.copier = device_copier(engine.device, staging_bytes)
        self.facts: ModelFacts = engine.facts
        self.channels = channels
        self.leases = Leases(kv_lease_s, kv_lease_bytes)
        self.test_layer_delay_s = test_layer_delay_s

    def admit(self, destination: Destination, params: SamplingParams) -> Destination:
        return destination  # every codec and transport; the engine samples any way

    def run(self, work: PrefillWork, job: JobProgress) -> Shipped:
        facts = self.engine.facts
        start = work.ship_from_token  # the decode region holds the KV before it
        shape = (facts.num_kv_heads, len(work.token_ids) - start, facts.head_dim)
        spec = ship_spec(work.job_id, work.attempt, work.destination, facts.dtype, (shape,) * facts.num_layers,
                         work.deadline - time.monotonic(), work.trace, self.engine.query_energy)  # fmt: skip
        shipment = Shipment(spec)
        with self.channels.ship(work.destination, shipment, kind="prefill") as transfer:
            job.attach(transfer.cancel)
            feed = self._feed(shipment, transfer, job.cancel)
            try:
                return self._run(work, job, start, transfer, feed)
            except BaseException:
                transfer.cancel()  # stopped before its staged buffers are let go
                raise
            finally:
                feed.end()

    def _run(self, work: PrefillWork, job: JobProgress, start: int, transfer: Transfer, feed: _Feed) -> Shipped:
        def on_layer(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if self.test_layer_delay_s:  # a cancel cuts it short
                job.stop.wait(self.test_layer_delay_s)
            job.check()
            if transfer.status() in (TransferStatus.FAILED, TransferStatus.TIMEOUT, TransferStatus.CANCELED):
                raise JobStopped  # e.g. the ticket was refused: computing on is wasted work
            if not work.ship_whole:
                feed.add(index, k, v, start)
                job.layer_shipped(index)

        t0 = time.monotonic()
        try:  # each layer's KV leaves as soon as the layer has written it, while the rest computes
            result = self.engine.prefill(work.token_ids, work.params, on_layer=on_layer, cache_salt=work.cache_salt)
        except JobStopped:
            _transfer_failed(job, transfer)
            raise
        prefill_s = time.monotonic() - t0
        self.leases.put(work.job_id, result, work.attempt)
        if job.stop.is_set():  # canceled after its last layer boundary: its Cancel found no lease to drop
            self.leases.drop(work.job_id, work.attempt)
            job.check()
        if work.ship_whole:
            for index, layer in enumerate(result.kv.layers):
                feed.add(index, layer.k, layer.v, start)
                job.layer_shipped(index)
        job.prefill_done(result.choices, _descriptor(self.facts, result), prefill_s, result.cached_tokens)
        status = wait_transfer(transfer, work.deadline, job.stop)
        if status is not TransferStatus.COMPLETED:
            if time.monotonic() >= work.deadline:  # wait_transfer canceled it there: the job's deadline, not a cancel
                job.cancel(DeadlineExceeded("the KV transfer did not finish by the job's deadline"))
            _transfer_failed(job, transfer)
            raise JobStopped
        return _shipped(transfer)

    def reship(self, job_id: str, attempt: int, destination: Destination, deadline: float,
               on_cancel: Callable[[Callable[[], None]], object]) -> Reshipped:  # fmt: skip
        lease = self.leases.hold(job_id)
        try:
            kv = lease.result.kv
            shapes = tuple((layer.k.shape[0], layer.k.shape[1], layer.k.shape[2]) for layer in kv.layers)
            spec = ship_spec(job_id, attempt, destination, kv.dtype, shapes, deadline - time.monotonic(),
                             key_weights=self.engine.query_energy)  # fmt: skip
            shipment = Shipment(spec)
            with self.channels.ship(destination, shipment, kind="reship") as transfer:
                on_cancel(transfer.cancel)
                feed = self._feed(shipment, transfer)
                try:
                    for index, layer in enumerate(kv.layers):
                        feed.add(index, layer.k, layer.v, 0)
                    status = wait_transfer(transfer, deadline, threading.Event())
                except BaseException:
                    transfer.cancel()
                    raise
                finally:
                    feed.end()
            if status is not TransferStatus.COMPLETED:
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded("the re-shipment did not finish by its deadline")
                raise transfer.error or DeadlineExceeded("re-shipment did not complete")
            return Reshipped(_shipped(transfer), _descriptor(self.engine.facts, lease.result), lease.result.choices)
        finally:
            self.leases.unhold(lease)

    def drop(self, job_id: str, attempt: int = 0) -> bool:
        return self.leases.drop(job_id, attempt)

    def close(self) -> None:
        self.leases.close()
        self.channels.close()

    def path_reports(self) -> list[tuple[str, PathReport]]:
        return self.channels.path_reports()

    def _feed(self, shipment: Shipment, transfer: Transfer,
              fail: Callable[[BaseException], None] | None = None) -> _Feed:  # fmt: skip
        """`fail(error)`: how a layer copy that never landed ends the job (with its reason); the transfer is
        canceled either way."""
        if self.copier is None:
            return _Feed(shipment, transfer, None)

        def failed(exc: BaseException) -> None:
            if fail is not None and isinstance(exc, TimeoutError):  # else the transfer's own error says it
                fail(DeadlineExceeded(f"KV copy out of device memory: {exc}"))
            transfer.cancel()

        return _Feed(shipment, transfer, StagedShipment(self.copier, shipment, failed=failed))


class _Feed:
    """How a shipment gets its layers: their bytes at once on the CPU; on a GPU, staged out of device memory
    (`StagedShipment`: the forward does not wait for the copy)."""

    def __init__(self, shipment: Shipment, transfer: Transfer, staged: StagedShipment | None) -> None:
        self.shipment = shipment
        self.transfer = transfer
        self.staged = staged

    def add(self, index: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Layer `index`'s K and V ([kv_heads, tokens, head_dim]) from token `start` on."""
        if start:
            k, v = k[:, start:].contiguous(), v[:, start:].contiguous()
        feed_layer(self.shipment, self.staged, index, k, v)

    def end(self) -> None:
        """The staged buffers back to the pool once the transfer completed; dropped from it otherwise (an
        encoder or sender of the canceled transfer may still read one)."""
        if self.staged is not None:
            self.staged.end(reuse=self.transfer.status() is TransferStatus.COMPLETED)


def _transfer_failed(job: JobProgress, transfer: Transfer) -> None:
    """End the job with the transfer's error, unless the job already has one (a cancel)."""
    job.cancel(transfer.error or Canceled("KV transfer ended early"))
    transfer.cancel()


def _descriptor(facts: ModelFacts, result: PrefillResult) -> common_pb2.KVDescriptor:
    kv = result.kv
    return kv_descriptor(facts, kv.num_tokens, kv.token_ids_hash)


def _shipped(transfer: Transfer) -> Shipped:
    stats = transfer.stats
    return Shipped(raw_bytes=stats.raw_bytes, wire_bytes=stats.wire_bytes, seconds=stats.seconds)
