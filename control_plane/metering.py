"""Metering: a finished job becomes its ledger entry, exactly once, off the request path.

The single hook is `Meter.job_done(job_id)`, called by the API process right after the job's `DONE`
transition (control_plane/generation.py). It only queues the id (no I/O): a background thread reads the job and
its timeline from Redis, prices the work (`PriceBook`: live or table $/GPU-hour, the link's egress $/GB from
the registry) and writes the ledger (`Ledger.record_once`: idempotent on the job id, so a second API process, a
retry or the reconciliation sweep never bills twice). Attempts that did not produce the answer (a failover, a
lost region) are recorded as the platform's cost (`Ledger.record_wasted`), never the tenant's.

The tenant's monthly spend in Redis (what admission checks budgets against, 402) is set from the ledger after
every new entry: spend = the ledger's sum over the month, raised only (a set-if-greater script), so racing
writers cannot lower it.

`reconcile(window_s)` (the beat task `prfaas.reconcile_ledger`) bills DONE jobs that have no entry (their API
process died between DONE and the write) and records the wasted attempts of FAILED / CANCELED jobs.

What is measured, per job (fields written into the job hash on the way, see `served_timing`):
- split: prefill GPU-s = the prefill region's `PrefillDone.prefill_s`; decode GPU-s = the decode stream's
  elapsed time from its first token to its last (`TokenEvent.elapsed_s`).
- local: prefill GPU-s = `Generate`'s elapsed time to its first token; decode GPU-s as above.
- a wasted attempt: the wall time its region held the job, from the attempt's timeline (PREFILLING -> next
  entry in the prefill region; TRANSFERRING / DECODING -> next entry in the decode region; LOCAL -> next entry).
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from prfaas.control_plane.jobs import JobNotFound, JobState
from prfaas.control_plane.ledger import JobUsage, Ledger, LedgerSettings, PriceTable, UsageEntry
from prfaas.control_plane.prices import PriceBook
from prfaas.control_plane.region_registry import RegionNotFound
from prfaas.control_plane.services import Services

log = logging.getLogger(__name__)

# Set the spend key to ARGV[1] unless it already holds more (spend only rises within a month).
_RAISE_SPEND = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end
return tostring(math.max(cur, tonumber(ARGV[1])))
"""


@dataclass(frozen=True)
class Work:
    """GPU time one attempt spent in one region without producing the answer."""

    attempt: int
    phase: str  # "prefill", "decode" or "local"
    region: str
    gpu_s: float
    reason: str


def served_timing(first: tuple[float, float] | None, last_elapsed_s: float) -> dict[str, float]:
    """Job-hash fields the API records with DONE: `first` = (wall time, stream elapsed s) of token 0."""
    if first is None:
        return {"gen_last_s": last_elapsed_s}
    return {"first_token_at": first[0], "gen_first_s": first[1], "gen_last_s": last_elapsed_s}


def _f(job: dict[str, str], name: str) -> float | None:
    value = job.get(name)
    return None if value in (None, "") else float(value)  # type: ignore[arg-type]


def _attempt_regions(job: dict[str, str], timeline: list[dict[str, Any]], attempt: int) -> tuple[str, str]:
    """(prefill region, decode region) of `attempt`: dispatch's `regions_a{n}`, else the timeline's notes."""
    recorded = job.get(f"regions_a{attempt}")
    if recorded and ">" in recorded:
        p, d = recorded.split(">", 1)
        return p, d
    prefill = decode = job.get("decode_region", "")
    for e in timeline:
        note = str(e.get("note", ""))
        if e.get("attempt") == attempt and note.startswith("prefill in "):
            prefill = note.removeprefix("prefill in ")
        if e.get("attempt") == attempt and note.startswith("local in "):
            prefill = decode = note.removeprefix("local in ")
    return prefill or decode, decode


def wasted_work(job: dict[str, str], timeline: list[dict[str, Any]], attempts: range) -> list[Work]:
    """The GPU time each attempt in `attempts` held a region, from the timeline."""
    out: list[Work] = []
    entries = sorted(timeline, key=lambda e: float(e["at"]))
    for a in attempts:
        mine = [e for e in entries if e.get("attempt") == a]
        later = [e for e in entries if int(e.get("attempt", 0)) > a or e["state"] in ("FAILED", "CANCELED")]
        prefill, decode = _attempt_regions(job, timeline, a)
        for i, e in enumerate(mine):
            phase = {"PREFILLING": "prefill", "TRANSFERRING": "decode", "DECODING": "decode", "LOCAL": "local"}
            if e["state"] not in phase:
                continue
            start = float(e["at"])
            ends = [float(x["at"]) for x in mine[i + 1 :] + later if float(x["at"]) >= start]
            end = min(ends) if ends else start
            reason = next((str(x.get("note", "")) for x in later if float(x["at"]) >= start), "")
            region = prefill if e["state"] == "PREFILLING" else decode
            out.append(Work(a, phase[e["state"]], region, max(0.0, end - start), reason))
    # one row per (attempt, phase): TRANSFERRING and DECODING of one attempt add up
    merged: dict[tuple[int, str], Work] = {}
    for w in out:
        prev = merged.get((w.attempt, w.phase))
        merged[(w.attempt, w.phase)] = w if prev is None else Work(w.attempt, w.phase, w.region, prev.gpu_s + w.gpu_s,
                                                                    prev.reason)  # fmt: skip
    return list(merged.values())


def job_usage(job: dict[str, str], timeline: list[dict[str, Any]]) -> JobUsage:
    """The bill of a DONE job: the work of its final attempt (the one that answered)."""
    attempt = int(job["attempt"])
    split = job.get("placement_chosen") == "split"
    decode_region = job.get("decode_region", "")
    prefill_region = job.get("prefill_region", decode_region) if split else decode_region
    first, last = _f(job, "gen_first_s"), _f(job, "gen_last_s")
    mine = {e["state"]: float(e["at"]) for e in timeline if e.get("attempt") == attempt}
    decode_s = max(0.0, last - first) if last is not None and first is not None else 0.0
    if split:
        prefill_s = _f(job, "prefill_gpu_s")
        if prefill_s is None and "PREFILLING" in mine and "TRANSFERRING" in mine:
            prefill_s = mine["TRANSFERRING"] - mine["PREFILLING"]
    else:
        prefill_s = first
        if prefill_s is None and "LOCAL" in mine and "DONE" in mine:
            prefill_s = mine["DONE"] - mine["LOCAL"]
    tokens_out = int(job.get("completion_tokens", 0) or 0)
    first_at = _f(job, "first_token_at")
    ttft = first_at - float(job["created_at"]) if first_at is not None else None
    tpot = decode_s / (tokens_out - 1) if tokens_out > 1 and last is not None and first is not None else None
    return JobUsage(
        job_id=job["id"], tenant=job["tenant"], model=job.get("model", ""), prefill_region=prefill_region,
        decode_region=decode_region, prefill_gpu_s=max(0.0, prefill_s or 0.0), decode_gpu_s=decode_s,
        tokens_in=int(job.get("prompt_tokens", 0) or 0), tokens_out=tokens_out,
        kv_bytes_raw=int(job.get("bytes_raw", 0) or 0) if split else 0,
        kv_bytes_wire=int(job.get("bytes_wire", 0) or 0) if split else 0,
        finished_at=dt.datetime.fromtimestamp(mine.get("DONE", float(job["updated_at"])), dt.UTC),
        placement="split" if split else "local", attempts=attempt, ttft_s=ttft, tpot_s=tpot,
    )  # fmt: skip


class MeteringMetrics:
    """Prometheus series of metering. Labels are bounded: region (the fleet's regions), phase, placement,
    market, source; never a tenant or a job."""

    def __init__(self, registry: CollectorRegistry, prices: PriceBook | None = None) -> None:
        self.prices = PriceCollector(prices)
        r = registry
        self.billed_usd = Counter("prfaas_billed_usd", "$ billed to tenants", ["phase", "region"], registry=r)
        self.colocated_usd = Counter(
            "prfaas_colocated_usd", "$ the billed jobs would have cost colocated in their decode region", ["region"],
            registry=r,
        )  # fmt: skip
        self.savings_usd = Gauge(
            "prfaas_savings_usd", "colocated $ - billed $ of jobs billed by this process", ["region"], registry=r
        )
        self.billed_jobs = Counter("prfaas_billed_jobs", "ledger entries written", ["placement"], registry=r)
        self.wasted_usd = Counter(
            "prfaas_wasted_usd", "platform cost of attempts that did not answer", ["phase", "region"], registry=r
        )
        self.write_s = Histogram("prfaas_ledger_write_seconds", "billing one job (read, price, write)", registry=r)
        self.errors = Counter("prfaas_ledger_errors", "billing attempts that raised", registry=r)
        self.queue_depth = Gauge("prfaas_ledger_queue_depth", "finished jobs waiting to be billed", registry=r)
        r.register(self.prices)

    def billed(self, entry: UsageEntry) -> None:
        self.billed_usd.labels("prefill", entry.prefill_region).inc(entry.prefill_usd)
        self.billed_usd.labels("decode", entry.decode_region).inc(entry.decode_usd)
        if entry.egress_usd:
            self.billed_usd.labels("egress", entry.prefill_region).inc(entry.egress_usd)
        self.colocated_usd.labels(entry.decode_region).inc(entry.colocated_usd)
        self.savings_usd.labels(entry.decode_region).inc(entry.savings_usd)
        self.billed_jobs.labels(entry.placement or "unknown").inc()


class PriceCollector(Collector):
    """Each cached or table price at scrape time: value, age, stale flag."""

    def __init__(self, prices: PriceBook | None) -> None:
        self.prices = prices

    def collect(self) -> Any:
        value = GaugeMetricFamily(
            "prfaas_price_usd_per_gpu_hour", "current $/GPU-hour", labels=["region", "market", "source"]
        )
        age = GaugeMetricFamily("prfaas_price_age_seconds", "age of the cached price", labels=["region", "market"])
        stale = GaugeMetricFamily("prfaas_price_stale", "1: older than max_age_s", labels=["region", "market"])
        try:
            quotes = self.prices.quotes() if self.prices is not None else []
        except Exception:  # a scrape must not fail because Redis blinked
            quotes = []
        for q in quotes:
            value.add_metric([q.region, q.market, q.source], q.usd_per_gpu_hour)
            age.add_metric([q.region, q.market], q.age_s or 0.0)
            stale.add_metric([q.region, q.market], float(q.stale))
        yield from (value, age, stale)


def month_window(now: float | None = None) -> tuple[dt.datetime, dt.datetime]:
    t = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.UTC)
    start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (start + dt.timedelta(days=32)).replace(day=1)
    return start, end


class Meter:
    def __init__(
        self,
        services: Services,
        ledger: Ledger,
        metrics: MeteringMetrics | None = None,
        *,
        batch_window_s: float = 0.05,
        max_batch: int = 256,
    ) -> None:
        self.s = services
        self.batch_window_s = batch_window_s  # the writer bills what queued in this long together
        self.max_batch = max_batch
        self.ledger = ledger
        self.prices: PriceBook = services.regions.prices
        self.metrics = metrics
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._raise_spend = services.redis.register_script(_RAISE_SPEND)

    # -- the hook ------------------------------------------------------------------------------

    def job_done(self, job_id: str) -> None:
        """Queue a DONE job for billing; returns at once (no I/O on the caller's path)."""
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
            batch = [self._queue.get()]
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
            try:
                if ids:
                    if self.metrics is not None:
                        self.metrics.queue_depth.dec(len(ids))
                    self._bill_batch(ids)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if len(ids) < len(batch):
                return

    def _bill_batch(self, job_ids: list[str]) -> None:
        try:
            self.bill_many(job_ids)
        except Exception:
            if self.metrics is not None:
                self.metrics.errors.inc()
            log.exception("billing %d jobs together failed; billing them one by one", len(job_ids))
            for job_id in job_ids:
                self._bill_retrying(job_id)

    def _bill_retrying(self, job_id: str, tries: int = 3) -> None:
        for i in range(tries):
            try:
                self.bill(job_id)
                return
            except Exception:
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

    def bill(self, job_id: str) -> UsageEntry | None:
        """Write the job's entry (and its wasted attempts) if it is DONE; the stored entry if billed before."""
        entries = self.bill_many([job_id])
        return entries[0] if entries else None

    def bill_many(self, job_ids: list[str]) -> list[UsageEntry]:
        """`bill` for several jobs: the jobs and their timelines read in one Redis round trip, the entries
        written in one ledger transaction, each tenant's spend raised once. Returns the entries of the jobs
        that are DONE (written now or before), in order; jobs gone or not DONE are skipped."""
        started = time.perf_counter()
        jobs: list[tuple[JobUsage, PriceTable]] = []
        tables: dict[tuple[str, str], PriceTable] = {}
        for found in self.s.jobs.with_timelines(job_ids):
            if found is None or found[0]["state"] != JobState.DONE:
                continue
            job = self._with_wire_bytes(found[0])
            usage = job_usage(job, found[1])
            self._record_wasted(job, found[1], range(1, usage.attempts))
            regions = (usage.prefill_region, usage.decode_region)
            if regions not in tables:
                tables[regions] = self.price_table(*regions)
            jobs.append((usage, tables[regions]))
        results = self.ledger.record_many(jobs)
        written = [entry for entry, inserted in results if inserted]
        spend: dict[str, float] = {}
        for entry in written:
            spend[entry.tenant] = spend.get(entry.tenant, 0.0) + entry.total_usd
        self.add_spends(spend)
        if self.metrics is not None:
            each_s = (time.perf_counter() - started) / max(1, len(written))
            for entry in written:
                self.metrics.billed(entry)
                self.metrics.write_s.observe(each_s)
        return [entry for entry, _ in results]

    def _with_wire_bytes(self, job: dict[str, str], wait_s: float = 5.0) -> dict[str, str]:
        """A split job's wire bytes come with the prefill region's `shipment_complete` event, which the
        dispatcher may record after DONE: wait for them a little (this runs off the request path)."""
        deadline = time.monotonic() + wait_s
        while job.get("placement_chosen") == "split" and not int(job.get("bytes_wire", 0) or 0):
            if time.monotonic() > deadline:
                log.warning("job %s: no wire bytes recorded after %.0f s; egress billed as 0", job["id"], wait_s)
                break
            time.sleep(0.05)
            job = self.s.jobs.get(job["id"])
        return job

    def _record_wasted(self, job: dict[str, str], timeline: list[dict[str, Any]], attempts: range) -> None:
        for w in wasted_work(job, timeline, attempts):
            if w.gpu_s <= 0:
                continue
            table = PriceTable({w.region: self.gpu_hour(w.region, prefill=w.phase == "prefill")})
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

    def add_spend(self, tenant: str, usd: float) -> None:
        """Add a newly written entry's $ to the tenant's monthly spend in Redis."""
        self.add_spends({tenant: usd})

    def add_spends(self, usd_by_tenant: dict[str, float]) -> None:
        """Add newly written entries' $ to each tenant's monthly spend in Redis, in one round trip. O(1) a
        job: summing the ledger's month at every bill grew with the month's jobs. The sweep (`reconcile`)
        raises the key to the ledger's sum, so a bill whose increment was lost (a crash between the two) is
        caught up."""
        if not usd_by_tenant:
            return
        with self.s.redis.pipeline() as pipe:
            for tenant, usd in usd_by_tenant.items():
                key = self.s.jobs.spend_key(tenant)
                pipe.incrbyfloat(key, usd)
                pipe.expire(key, 40 * 86400)
            pipe.execute()

    def sync_spend(self, tenant: str) -> float:
        """Raise the tenant's monthly spend in Redis to the ledger's sum for the month."""
        start, end = month_window()
        total = self.ledger.spend(tenant, start, end)
        key = self.s.jobs.spend_key(tenant)
        return float(self._raise_spend(keys=[key], args=[repr(total), 40 * 86400]))

    def reconcile(self, window_s: float = 3600.0) -> int:
        """Bill DONE jobs finished in the last `window_s` that have no entry; record the wasted attempts of
        FAILED / CANCELED ones. Returns the number of entries written."""
        written = 0
        now = time.time()
        for tenant in self.s.tenants.all():
            index = self.s.settings.key("tenant", tenant.id, "jobs")
            for raw in self.s.redis.zrangebyscore(index, now - window_s - self.s.settings.job_timeout_s, now):  # type: ignore[union-attr]
                job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
                try:
                    job = self.s.jobs.get(job_id)
                except JobNotFound:
                    continue
                if job["state"] == JobState.DONE and self.ledger.entry(job_id) is None:
                    written += self.bill(job_id) is not None
                elif job["state"] in (JobState.FAILED, JobState.CANCELED):
                    self._record_wasted(job, self.s.jobs.timeline(job_id), range(1, int(job["attempt"]) + 1))
            self.sync_spend(tenant.id)
        return written


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, MeteringMetrics] = weakref.WeakKeyDictionary()


def open_meter(services: Services, registry: CollectorRegistry | None = None) -> Meter:
    """A Meter on the ledger at `PRFAAS_LEDGER_URL` (migrated to head), its metrics in `registry`."""
    metrics = None
    if registry is not None:  # one set per registry: an app's lifespan may run more than once (tests)
        metrics = _METRICS.get(registry)
        if metrics is None:
            metrics = _METRICS[registry] = MeteringMetrics(registry)
        metrics.prices.prices = services.regions.prices
    return Meter(services, Ledger(LedgerSettings().ledger_url), metrics)
