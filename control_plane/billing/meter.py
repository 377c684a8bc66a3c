"""Metering: a finished job becomes its ledger entry, exactly once, off the request path.

The single hook is `Meter.job_done(job_id)`, called by the API process right after the job's `DONE` transition
(control_plane/jobs/generation.py), and for a job its client canceled (billed up to the cut). It only queues the id
(no I/O): a background thread reads the job and its timeline from Redis, prices the work (`PriceBook`: live or
table $/GPU-hour, the link's egress $/GB from the registry) and writes the ledger (`Ledger.record_many`: idempotent
on the job id, so a second API process, a retry or the reconciliation sweep (billing/reconcile.py) never bills
twice). Attempts that did not produce the answer (a failover, a lost region) are recorded as the platform's cost
(`Ledger.record_wasted_once`), never the tenant's. What each job is billed: billing/usage.py. After every write the
tenants' monthly spend in Redis rises by the new entries' $ and their jobs' budget reservations end, in one step
(billing/spend.py).
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
import weakref
from typing import Any

from prometheus_client import CollectorRegistry

from prfaas.control_plane.billing.costs import JobUsage, PriceTable
from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.metrics import MeteringMetrics
from prfaas.control_plane.billing.models import UsageEntry
from prfaas.control_plane.billing.prices import PriceBook
from prfaas.control_plane.billing.spend import TenantSpend
from prfaas.control_plane.billing.usage import billable, job_usage, wasted_work
from prfaas.control_plane.fleet.records import RegionNotFound
from prfaas.control_plane.jobs.latency import LatencyMetrics, stage_seconds
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services

log = logging.getLogger(__name__)
WIRE_BYTES_WAIT_S = 5.0  # a biller waits this long for split jobs' wire bytes recorded after DONE
WIRE_BYTES_GRACE_S = 300.0  # after this long past DONE it is billed without them (at once: job.ttl_s under 600 s)
WIRE_RETRY_S = (5.0, 60.0)  # a biller tries a job whose wire bytes did not come again after 5 s, doubling to 60 s
WIRE_FIELDS = ["bytes_raw", "bytes_wire"]


def _wire_missing(job: dict[str, str]) -> bool:
    return job.get("placement_chosen") == "split" and not int(job.get("bytes_wire", 0) or 0)


class Meter:
    """Bills finished jobs into the ledger, off the request path (see the module docstring)."""

    def __init__(
        self,
        services: Services,
        ledger: Ledger,
        registry: CollectorRegistry | None = None,
        *,
        batch_window_s: float = 0.05,
        max_batch: int = 256,
        wire_wait_s: float = WIRE_BYTES_WAIT_S,
    ) -> None:
        """`registry`: where this process's metering metrics and the stage latencies of the jobs it bills are
        exported; None: neither is kept."""
        self.s = services
        self.batch_window_s = batch_window_s  # the writer bills what queued in this long together
        self.max_batch = max_batch
        self.wire_wait_s = wire_wait_s  # the writer waits this long for a batch's late wire bytes, then defers
        self.ledger = ledger
        self.prices: PriceBook = services.regions.prices
        # latency: the stage histograms of the jobs this process bills (jobs/latency.py)
        self.metrics, self.latency = _metrics_in(registry, self.prices)
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._later: list[tuple[float, str, float]] = []  # heap: (due, monotonic; job id; the delay it waited)
        self._retrying: dict[str, float] = {}  # job id -> its next delay: deferred jobs, already waited for
        self.spend = TenantSpend(services.redis, services.jobs)

    # -- the hook ------------------------------------------------------------------------------

    def job_done(self, job_id: str) -> None:
        """Queue a finished job for billing; returns at once (no I/O on the caller's path). A job that turns out
        not `billable` (billing/usage.py: not DONE, nor canceled by its client after tokens came) is skipped."""
        self._queue.put_nowait(job_id)
        if self.metrics is not None:
            self.metrics.queue_depth.inc()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            batch = [self._next()]
            if batch[0] is not None and self.batch_window_s > 0:
                # Let more jobs queue: every job billed with the others of its window costs one Redis round trip,
                # one ledger transaction and one spend update per window, not per job. No waiter during the
                # sleep, so `job_done` (on the request path) wakes nobody.
                time.sleep(self.batch_window_s)
            while len(batch) < self.max_batch and batch[-1] is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            ids = [job_id for job_id in batch if job_id is not None]
            deferred: list[str] = []
            try:
                if ids:
                    self._bill_batch(ids, deferred)
            finally:
                if ids and self.metrics is not None:  # billed (or left to the reconciliation sweep); not the deferred
                    self.metrics.queue_depth.dec(len(ids) - len(deferred))
                for _ in batch:
                    self._queue.task_done()
            if len(ids) < len(batch):
                if self._later:  # closing: the reconciliation sweep bills them
                    log.info("%d jobs left waiting for their wire bytes", len(self._later))
                    if self.metrics is not None:
                        self.metrics.queue_depth.dec(len(self._later))
                return

    def _next(self) -> str | None:
        """The next job to bill: a queued one, or a deferred one whose retry is due (queued again)."""
        while True:
            with self._lock:  # every retry due, queued together: billed in one batch
                while self._later and self._later[0][0] <= time.monotonic():
                    _, job_id, waited = heapq.heappop(self._later)
                    self._retrying[job_id] = min(2 * waited, WIRE_RETRY_S[1])
                    self._queue.put_nowait(job_id)
                due_in = self._later[0][0] - time.monotonic() if self._later else None
            try:
                return self._queue.get(timeout=due_in if due_in is None or due_in > 0 else 0.001)
            except queue.Empty:
                continue

    def _defer(self, job_ids: list[str]) -> None:
        """Try these jobs again later, from this process (its metrics observe them): their wire bytes may come."""
        with self._lock:
            for job_id in job_ids:
                delay = self._retrying.get(job_id, WIRE_RETRY_S[0])
                heapq.heappush(self._later, (time.monotonic() + delay, job_id, delay))

    def _bill_batch(self, job_ids: list[str], deferred: list[str]) -> None:
        try:
            self.bill_many(job_ids, self.wire_wait_s, deferred)
        except Exception:
            deferred.clear()  # one by one below (one unpriced job stops no other)
            if self.metrics is not None:
                self.metrics.errors.inc()
            log.exception("billing %d jobs together failed; billing them one by one", len(job_ids))
            for job_id in job_ids:
                self._bill_retrying(job_id, deferred)
        for job_id in set(job_ids) - set(deferred):
            self._retrying.pop(job_id, None)
        self._defer(deferred)

    def _bill_retrying(self, job_id: str, deferred: list[str], tries: int = 3) -> None:
        for i in range(tries):
            try:
                self.bill_many([job_id], self.wire_wait_s, deferred)
                return
            except Exception:
                deferred[:] = [other for other in deferred if other != job_id]  # deferred by a try that then failed
                if self.metrics is not None:
                    self.metrics.errors.inc()
                log.exception("billing job %s failed (try %d of %d)", job_id, i + 1, tries)
                time.sleep(0.2 * 2**i)
        # the reconciliation sweep bills it later

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued job is billed (tests, shutdown); False at the deadline."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)

    # -- billing -------------------------------------------------------------------------------

    def bill(self, job_id: str, wait_s: float = WIRE_BYTES_WAIT_S) -> UsageEntry | None:
        """Write the job's entry (and its wasted attempts) if it is `billable`; the stored entry if billed before.
        None: not billable, gone, or a split job whose wire bytes have not come yet (see `bill_many`)."""
        entries = self.bill_many([job_id], wait_s)
        return entries[0] if entries else None

    def bill_many(
        self, job_ids: list[str], wait_s: float = WIRE_BYTES_WAIT_S, deferred: list[str] | None = None
    ) -> list[UsageEntry]:
        """`bill` for several jobs: the jobs and their timelines read in one Redis round trip, the entries
        written in one ledger transaction, each tenant's spend raised (its jobs' reservations settled) once.
        Returns the entries of the `billable` jobs (written now or before), in order; jobs gone or not billable
        are skipped, and so is a split job whose wire bytes are not recorded yet, after `wait_s` for all of them
        together (not for one deferred before), unless it finished over its grace ago (`_past_wire_grace`: then its
        egress is billed as 0); its id is added to `deferred`."""
        started = time.perf_counter()
        jobs: list[tuple[JobUsage, PriceTable]] = []
        stages: dict[str, tuple[dict[str, str], dict[str, float]]] = {}
        tables: dict[tuple[str, str], PriceTable] = {}
        cut: set[str] = set()
        done = [f for f in self.s.jobs.with_timelines(job_ids) if f is not None and billable(f[0])]
        for job, timeline in self._with_wire_bytes(done, wait_s):
            usage = job_usage(job, timeline)
            if usage.placement == "split" and not usage.kv_bytes_wire and not self._past_wire_grace(usage):
                if deferred is not None:  # its wire bytes may still come: billed later (its reservation holds)
                    deferred.append(usage.job_id)
                continue
            if job["state"] != JobState.DONE:  # canceled by its client: billed up to the cut, its stages cut short
                cut.add(usage.job_id)
            elif self.latency is not None:
                stages[usage.job_id] = (job, stage_seconds(job, timeline, usage.tpot_s))
            self.record_wasted(job, timeline, range(1, usage.attempts))
            regions = (usage.prefill_region, usage.decode_region)
            if regions not in tables:
                tables[regions] = self.price_table(*regions)
            jobs.append((usage, tables[regions]))
        with self.spend.settling({usage.tenant for usage, _ in jobs}) as lease:  # no sync counts an entry in between
            results = self.ledger.record_many(jobs)
            written = [entry for entry, inserted in results if inserted]
            try:  # only the writer of an entry settles it: the spend rises once per job (a crash in between: reconcile)
                late = self.spend.settle(((e.tenant, e.job_id, e.total_usd, e.finished_at) for e in written), lease)
            finally:  # the entries are written: their metrics too (a retry finds them written, and observes nothing)
                self._observe(written, stages, cut, started)
        finished = {e.job_id: e.finished_at for e in written}
        for tenant, ids in late.items():  # the lease ran out before the settle (a stall): syncs count them instead
            self.spend.catch_up(tenant, self.ledger, {job_id: finished[job_id] for job_id in ids})
        return [entry for entry, _ in results]

    def _observe(
        self, written: list[UsageEntry], stages: dict[str, tuple[dict[str, str], dict[str, float]]], cut: set[str],
        started: float,
    ) -> None:  # fmt: skip
        if self.metrics is not None:
            each_s = (time.perf_counter() - started) / max(1, len(written))
            for entry in written:
                self.metrics.billed(entry, cut=entry.job_id in cut)
                self.metrics.write_s.observe(each_s)
        if self.latency is not None:  # once per job: by the process whose write inserted its entry
            for entry in written:
                if entry.job_id in stages:
                    self.latency.observe(*stages[entry.job_id])

    def _with_wire_bytes(
        self, done: list[tuple[dict[str, str], list[dict[str, Any]]]], wait_s: float
    ) -> list[tuple[dict[str, str], list[dict[str, Any]]]]:
        """A split job's wire bytes come with the prefill region's `shipment_complete` event, which the
        dispatcher may record after DONE: wait up to `wait_s` for those of all of `done` together, reading only
        the jobs still without them (this runs off the request path; one late job holds the batch once)."""
        by_id = {job["id"]: job for job, _ in done}
        missing = {job_id for job_id, job in by_id.items() if _wire_missing(job) and job_id not in self._retrying}
        deadline = time.monotonic() + wait_s
        while missing and time.monotonic() < deadline:
            time.sleep(0.05)
            ids = sorted(missing)
            for job_id, fields in zip(ids, self.s.jobs.fields_of(ids, WIRE_FIELDS), strict=True):
                if fields is not None and int(fields.get("bytes_wire", 0) or 0):
                    missing.discard(job_id)
                    by_id[job_id].update(fields)  # DONE is final: these are the answering attempt's
        return done

    def _past_wire_grace(self, usage: JobUsage) -> bool:
        """Whether a split job without wire bytes is billed anyway (its egress as 0): its prefill region's event
        is lost (the region died after the hand-off, the dispatcher's stream broke). No grace where jobs are kept
        under twice it (`job.ttl_s`): a job gone from Redis is billed by nobody."""
        # billed while Redis still holds it: jobs kept under twice the grace (a short job.ttl_s) are not deferred
        grace_s = WIRE_BYTES_GRACE_S if self.s.settings.job.ttl_s >= 2 * WIRE_BYTES_GRACE_S else 0.0
        age_s = time.time() - usage.finished_at.timestamp() if usage.finished_at is not None else grace_s
        if age_s < grace_s:
            return False
        log.warning("job %s: no wire bytes recorded %.0f s after DONE; egress billed as 0", usage.job_id, age_s)
        return True

    def record_wasted(self, job: dict[str, str], timeline: list[dict[str, Any]], attempts: range) -> None:
        """Record the GPU time of each of `attempts` (that did not answer) as the platform's cost, once."""
        for w in wasted_work(job, timeline, attempts):
            if w.gpu_s <= 0:
                continue
            try:
                table = PriceTable({w.region: self.gpu_hour(w.region, prefill=w.phase == "prefill")})
            except KeyError as exc:  # the platform's own cost, unpriced: never a reason not to bill the tenant
                log.warning("job %s attempt %d: wasted %s not recorded: %s", job["id"], w.attempt, w.phase, exc)
                continue
            row, inserted = self.ledger.record_wasted_once(
                job_id=job["id"], attempt=w.attempt, phase=w.phase, tenant=job["tenant"], region=w.region,
                gpu_s=w.gpu_s, prices=table, reason=w.reason[:500],
            )  # fmt: skip
            if inserted and self.metrics is not None:
                self.metrics.wasted_usd.labels(w.phase, w.region).inc(row.cost_usd)

    def gpu_hour(self, region: str, *, prefill: bool) -> float:
        """The price a region's work is billed at: a split prefill at the spot price when there is one (as the
        scheduler's cost model assumes, `prefill_on_spot`), else on-demand; the region's registered price when
        no price is configured for it."""
        if prefill:
            spot = self.prices.spot(region)
            if spot is not None:
                return spot
        on_demand = self.prices.on_demand(region)
        if on_demand is not None:
            return on_demand
        try:
            return self.s.regions.get(region).usd_per_gpu_hour
        except RegionNotFound:
            raise KeyError(f"no $/GPU-hour for region {region!r}") from None

    def price_table(self, prefill_region: str, decode_region: str) -> PriceTable:
        split = bool(prefill_region) and prefill_region != decode_region
        gpu = {decode_region: self.gpu_hour(decode_region, prefill=False)}
        egress: dict[tuple[str, str], float] = {}
        if split:
            gpu[prefill_region] = self.gpu_hour(prefill_region, prefill=True)
            links = {(x.src, x.dst): x.egress_usd_per_gb for x in self.s.regions.links()}
            egress[(prefill_region, decode_region)] = links.get((prefill_region, decode_region), 0.0)
        return PriceTable(gpu, egress)


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, tuple[MeteringMetrics, LatencyMetrics]] = (
    weakref.WeakKeyDictionary()
)


def _metrics_in(
    registry: CollectorRegistry | None, prices: PriceBook
) -> tuple[MeteringMetrics | None, LatencyMetrics | None]:
    """The metering metrics and stage latencies in `registry`, their price collector reading `prices`; (None, None)
    without a registry. One set per registry: an app's lifespan may run more than once (tests)."""
    if registry is None:
        return None, None
    if registry not in _METRICS:
        _METRICS[registry] = (MeteringMetrics(registry), LatencyMetrics(registry))
    metrics, latency = _METRICS[registry]
    metrics.prices.prices = prices
    return metrics, latency


def open_meter(services: Services, registry: CollectorRegistry | None = None) -> Meter:
    """A Meter on the ledger at `Settings.ledger.url` (migrated to head), its metrics in `registry`."""
    ledger = Ledger(services.settings.ledger.url, engine=services.database, migrate=False)
    return Meter(services, ledger, registry)
