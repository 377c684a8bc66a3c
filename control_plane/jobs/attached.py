"""A request attached to a running job (an Idempotency-Key retry while it runs): the job's tokens read from its
token log (jobs/tokenlog.py), not decoded again. The reader counts from the moment it attaches, not from its
first read: a job whose own client leaves between the retry's admission and its first read is not canceled
under it (`Follower.left` sees the reader). Closed before it was read, it stops counting at once."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Generator, Iterator

import redis

from prfaas.control_plane.jobs.errors import STORE_LOST, JobEnded, JobNotFound
from prfaas.control_plane.jobs.records import job_sampling
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.jobs.store import SHUTTING_DOWN, JobStore
from prfaas.control_plane.jobs.tokenlog import Outputs, Token, TokenLog, recorded_tokens
from prfaas.control_plane.settings import Settings


class AttachedReader(Iterator[Token]):
    """The job's tokens for one attached request; counted among the job's readers from construction (renewed
    every `beat_s` while read) until its end or `close`. A store error while reading ends it as JobEnded."""

    def __init__(self, jobs: JobStore, log: TokenLog, settings: Settings, job_id: str, owner: str,
                 ending: threading.Event | None = None) -> None:  # fmt: skip
        self.jobs, self.log, self.settings, self.job_id = jobs, log, settings, job_id
        self.ending = ending or threading.Event()  # its process shuts down: it ends (as canceled) at its next look
        self.reader = f"{owner or 'reader'}:{uuid.uuid4().hex[:12]}"
        log.attach(job_id, self.reader)
        self._tokens = self._read(time.monotonic())
        self._started = False

    def __next__(self) -> Token:
        self._started = True
        try:
            return next(self._tokens)
        except (redis.RedisError, JobNotFound):  # the job is another request's: that one ends it
            raise JobEnded("FAILED", STORE_LOST) from None

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError):  # Redis away: it stops counting after `reader_s`
            if not self._started:  # its generator never ran: no `finally` of its own to detach it
                self.log.detach(self.job_id, self.reader)
            self._tokens.close()  # its `finally` detaches it

    def _read(self, renewed: float) -> Generator[Token, None, None]:
        job_id, renew_s = self.job_id, self.settings.beat_s
        deadline = time.monotonic() + self.settings.job.timeout_s
        try:
            seen, output = 0, Outputs(())
            n = job_sampling(self.jobs.get(job_id)).n
            while True:
                if time.monotonic() - renewed >= renew_s:  # counted while it reads (jobs/tokenlog.py)
                    self.log.attach(job_id, self.reader)
                    renewed = time.monotonic()
                if self.ending.is_set():
                    raise JobEnded("CANCELED", f"canceled: {SHUTTING_DOWN}")
                found = self.log.wait_tokens(job_id, seen, max(0.0, min(renew_s, deadline - time.monotonic())))
                for token in found:
                    seen += 1
                    if not output.add(token):
                        continue  # logged twice (an adopting follower and the one it replaced): sent once
                    yield token
                    if output.done(n):
                        return
                if found:
                    continue
                job = self.jobs.get(job_id)
                if job["state"] in (JobState.FAILED, JobState.CANCELED):
                    raise JobEnded(job["state"], job.get("error") or job["state"].lower())
                if job["state"] == JobState.DONE:  # its log is gone (expired): its record has the tokens
                    for token in recorded_tokens(job):
                        if output.add(token):
                            yield token
                    return
                if time.monotonic() >= deadline:
                    raise JobEnded("TIMEOUT", f"no result within {self.settings.job.timeout_s:g} s")
        finally:
            self.log.detach(job_id, self.reader)
