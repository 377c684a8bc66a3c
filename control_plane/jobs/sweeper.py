"""The sweeper: every `sweep_s`, in every worker process, it takes back what nobody will finish.

- A lease past its deadline (the stage overran the scheduler's prediction x `lease.factor`), or
  whose owner stopped beating (its worker died: SIGKILL, OOM, host lost): the attempt is
  stopped in its regions (prefill canceled, decode reservation released, both best effort) and
  handed to jobs/attempts.py: the next attempt (an overrun leaves its instance out), or FAILED.
- A `queued` lease past its deadline or whose owner died: the job's dispatch was never started
  (the task was lost between the move to QUEUED, or the job's creation, and the enqueue): it is
  queued again, if the job is still QUEUED at that attempt and no dispatch claimed it.
- A job followed by an API process that stopped beating: nobody streams its tokens any more.
  One asked with an Idempotency-Key is adopted: a follower in this worker streams it to its
  end into its token log (a decode the dead process held is run again: the next attempt,
  reshipping the KV from the prefill region that leases it), and the client's retry with the
  same key attaches to it (jobs/tokenlog.py). Any other job ends FAILED with the reason (no
  client could ever read its answer), then is stopped in its regions; its concurrency slot
  returns with the move (jobs/store.py).

Every take-back is a claim in Redis (jobs/leases.py), so two sweepers never act on one lease. A
claim the sweeper could not act on (Redis away a moment, an adoption that failed) is given back
(the lease put back, the follow restored) at the start of its next pass, which takes it again:
taken for good, nothing would ever move the job on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc

from prfaas.control_plane.jobs.attempts import Attempts
from prfaas.control_plane.jobs.errors import IllegalTransition, JobNotFound, StaleAttempt
from prfaas.control_plane.jobs.leases import Heartbeats, Lease, Leases
from prfaas.control_plane.jobs.periodic import Periodic
from prfaas.control_plane.jobs.states import TERMINAL, JobState
from prfaas.control_plane.jobs.store import JobStore
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from prfaas.region.channels import ChannelCache
from prfaas.transport.identity import server_name

log = logging.getLogger(__name__)


def _sweep_failed(exc: Exception) -> None:
    # never let the thread die: a job it cannot handle must not stop the others'
    log.exception("sweep failed; the next one tries again", exc_info=exc)


class Sweeper:
    def __init__(self, jobs: JobStore, leases: Leases, attempts: Attempts, beats: dict[str, Heartbeats],
                 channels: ChannelCache, adopt: Callable[[str, int], None] | None = None) -> None:  # fmt: skip
        """`adopt(job_id, stale_attempt)`: follow an orphaned job to its end from this process
        (None: orphans end FAILED)."""
        self.adopt = adopt
        self.jobs = jobs
        self.leases = leases
        self.attempts = attempts
        self.beats = beats  # by kind: "worker", "api"
        self.channels = channels
        self.settings = jobs.settings
        self._ticker = Periodic("prfaas-sweeper", self.settings.sweep_s, self.sweep, _sweep_failed)
        self._cancels = ThreadPoolExecutor(4, thread_name_prefix="prfaas-sweeper-cancel")  # Cancels: 2 s each
        self._missing: dict[str, float] = {}  # owners with no beat at all -> when this sweeper first saw that
        self._last_pass: float | None = None  # when the last pass read the beats (None: none yet)
        self._back_since = float("-inf")  # when this sweeper came back from a gap (Redis away, a stall)
        self._give_back: list[Callable[[], object]] = []  # claims a pass took and could not act on

    def start(self) -> Sweeper:
        self._ticker.start()
        return self

    def stop(self) -> None:
        self._ticker.stop(join_s=10)
        self._cancels.shutdown(wait=False)

    def sweep(self) -> list[str]:
        """One pass; what it did, a line per job."""
        now = time.time()
        if self._last_pass is not None and now - self._last_pass > 2 * self.settings.sweep_s + 1:
            # passes were missed (Redis away, this process stalled): the beats the others could not write
            # meanwhile say nothing of them; none is dead before it has had `dead_after_s` to beat again
            self._back_since = now
        alive = set().union(*(b.alive() for b in self.beats.values()))
        known = set().union(*(b.known() for b in self.beats.values()))
        self._last_pass = now  # Redis answered (a pass that fails later on a job is no gap)
        missing, self._missing = self._missing, {}  # kept for the owners this pass still finds without a beat
        while self._give_back:  # before the reads: what is given back is taken again below
            self._give_back[0]()  # Redis still away: the pass fails here, and the next one gives it back
            self._give_back.pop(0)
        done = []
        clock = self.leases.clock.now()  # deadlines are on Redis's clock
        for lease in self.leases.all():
            overran, orphaned = lease.deadline < clock, self._dead(lease.owner, alive, known, missing, now)
            if not (overran or orphaned) or not self.leases.take_exact(lease):  # not one granted since it was read
                continue
            recover, give_back = partial(self._recover, lease, overran), partial(self.leases.restore, lease)
            done.append(self._act(lease.job_id, recover, give_back))
        api = self.beats.get("api")
        if api is not None:
            for job_id, owner in self.leases.following().items():
                if self._dead(owner, alive, known, missing, now) and self.leases.unfollow(job_id, owner):
                    done.append(self._act(job_id, partial(self._orphaned, job_id, owner),
                                          partial(self.leases.refollow, job_id, owner)))  # fmt: skip
        return done

    def _act(self, job_id: str, act: Callable[[], str], give_back: Callable[[], object]) -> str:
        """`act` on what this pass took of the job (its lease, its follow); if it fails, the claim is given
        back at the next pass's start (`give_back`), and that pass takes it again."""
        try:
            return act()
        except Exception:  # one job's failure holds no other's recovery up
            log.exception("job %s: sweeping it failed; the next pass takes it again", job_id)
            self._give_back.append(give_back)
            return f"{job_id}: failed, given back"

    def _dead(self, owner: str, alive: set[str], known: set[str], missing: dict[str, float], now: float) -> bool:
        """Its beats aged past `dead_after_s` (or it said it stopped); or it has none at all, for as long: a
        Redis that came back empty lost every beat, and a live process beats again within `beat_s`. Never
        within `dead_after_s` of this sweeper's return from a gap (a Redis outage stopped every beat)."""
        if owner in alive or now - self._back_since <= self.settings.dead_after_s:
            return False
        if owner in known:
            return True
        since = self._missing[owner] = missing.get(owner, now)
        return now - since > self.settings.dead_after_s

    def _recover(self, lease: Lease, overran: bool) -> str:
        try:
            job = self.jobs.get(lease.job_id)
        except JobNotFound:
            return f"{lease.job_id}: gone"
        if job["state"] in TERMINAL or int(job["attempt"]) != lease.attempt:
            return f"{lease.job_id}: moved on"
        over_s = self.leases.clock.now() - lease.deadline
        late = f"overran its lease by {over_s:.1f} s" if overran else f"lost {lease.owner}"
        if lease.stage == "queued":  # its dispatch never started: queue it again, unless a dispatch claimed it since
            if not self.attempts.requeue(lease.job_id, lease.attempt):
                return f"{lease.job_id}: moved on"
            return f"{lease.job_id}: dispatch {late}, queued again"
        where = lease.where if overran else ""  # a dead worker is no fault of the instance
        reason = f"{lease.stage} of attempt {lease.attempt} on {lease.where or 'a worker'} {late}"
        # the next attempt first (moved and guarded by its lease before this process may die), then the regions
        # told, beside the pass (a region that does not answer holds no other job's recovery up)
        outcome = self.attempts.fail(lease.job_id, lease.attempt, where, reason)
        self._cancels.submit(self._stop_quietly, job, f"{lease.stage} {late}", lease.attempt)
        return f"{lease.job_id}: {outcome} ({reason})"

    def _orphaned(self, job_id: str, owner: str) -> str:
        reason = f"the API process following it ({owner}) stopped"
        for _ in range(3):  # a concurrent move (a region's event) makes the attempt stale: read again
            try:
                job = self.jobs.get(job_id)
                if job["state"] in TERMINAL:
                    return f"{job_id}: already {job['state']}"
                if self.adopt is not None and job.get("idempotent"):
                    return self._adopted(job, reason)
                self.jobs.transition(job_id, JobState.FAILED, int(job["attempt"]), note=reason, error=reason,
                                     tenant=job["tenant"])  # fmt: skip
                # then its regions are told, beside the pass (a region that does not answer holds no other job up)
                self._cancels.submit(self._stop_quietly, job, reason, int(job["attempt"]))
                return f"{job_id}: FAILED ({reason})"
            except (StaleAttempt, IllegalTransition):
                continue
            except JobNotFound:
                return f"{job_id}: gone"
        return f"{job_id}: moved on"

    def _adopted(self, job: dict[str, str], reason: str) -> str:
        assert self.adopt is not None
        job_id, attempt = job["id"], int(job["attempt"])
        if job["state"] in (JobState.TRANSFERRING, JobState.DECODING, JobState.LOCAL):  # its decode died with it
            self._stop_decode(job, reason, attempt)  # its call may not have ended: the next one is refused meanwhile
            reship: dict[str, str] | str = ""
            if job["state"] != JobState.LOCAL and job.get("prefill_instance"):
                reship = {"region": job["prefill_region"], "instance": job["prefill_instance"]}
            outcome = self.attempts.fail(job_id, attempt, "", reason, reship_from=reship)
            if outcome == "failed" or (outcome == "superseded" and not self._live(job_id)):
                return f"{job_id}: {outcome} ({reason})"
            # retrying, or superseded by a newer attempt that another process queued (a sweeper's lease
            # recovery, a failed stage) while this one stopped the decode: none of those follows it, this one must
            self.adopt(job_id, attempt)
        else:  # not decoding yet: its dispatch goes on, the hand-off is still to come
            self.adopt(job_id, attempt - 1)
        return f"{job_id}: adopted ({reason})"

    def _live(self, job_id: str) -> bool:
        try:
            return self.jobs.get(job_id)["state"] not in TERMINAL
        except JobNotFound:
            return False

    def _stop_quietly(self, job: dict[str, str], reason: str, attempt: int) -> None:
        try:
            self._stop_in_regions(job, reason, attempt)
        except Exception:  # best effort: the regions end the attempt at its deadline
            log.exception("job %s: telling its regions that attempt %d ended failed", job["id"], attempt)

    def _stop_in_regions(self, job: dict[str, str], reason: str, attempt: int) -> None:
        """Cancel `attempt` of the job (and older ones) in its prefill and its decode region (idempotent
        there: a prefill stops, a reservation is released, a decode ends; a newer attempt's work is kept,
        for the job record read here may be older than what another sweeper or API process did since; a
        region that does not answer lets them expire on their own)."""
        request = common_pb2.CancelRequest(job_id=job["id"], reason=reason, attempt=attempt)
        if job.get("prefill_grpc"):
            channel = self.channels.get(job["prefill_grpc"], server_name(job.get("prefill_region", "")))
            with contextlib.suppress(grpc.RpcError):
                prefill_pb2_grpc.PrefillRegionStub(channel).Cancel(request, timeout=2)
        self._stop_decode(job, reason, attempt)

    def _stop_decode(self, job: dict[str, str], reason: str, attempt: int) -> None:
        """Cancel `attempt` of the job in its decode region only (a prefill region's KV lease is kept for a
        reship)."""
        request = common_pb2.CancelRequest(job_id=job["id"], reason=reason, attempt=attempt)
        if job.get("decode_grpc"):
            channel = self.channels.get(job["decode_grpc"], server_name(job.get("decode_region", "")))
            with contextlib.suppress(grpc.RpcError):
                decode_pb2_grpc.DecodeRegionStub(channel).Cancel(request, timeout=2)
