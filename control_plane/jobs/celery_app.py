"""The Celery application (Redis broker): `dispatch_job(job_id)`, a short task (claim, place,
reserve, start the prefill; jobs/dispatch.py) with `acks_late`, so a task whose worker died
before it ran is handed to another. In a worker process, from `worker_init` on: its heartbeat
(jobs/leases.py), the watcher that reads the prefill streams it started (jobs/watcher.py) and
the sweeper (jobs/sweeper.py). A worker process:

    PRFAAS_ADMIN_KEY=... PRFAAS_TICKET_KEY=... celery -A prfaas.control_plane.worker worker --pool threads
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from prfaas.control_plane.settings import Settings

log = logging.getLogger(__name__)
TASK = "prfaas.dispatch_job"
BROKER_TIMEOUT_S = 5.0  # each broker connect, read and write


def make_celery(settings: Settings, *, worker: bool = False) -> Celery:
    app = Celery("prfaas", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue="dispatch",  # the Redis list `<key_prefix>:dispatch` (global_keyprefix below)
        broker_transport_options={
            # every broker key under the deployment's prefix (the queue, its bindings, kombu's unacked hash and
            # deadlines): deployments sharing a Redis stay apart, and `prfaas down` leaves none of them behind
            "global_keyprefix": settings.key(""),
            "visibility_timeout": settings.dispatch.visibility_s,
            # kombu sweeps for unacked messages past visibility_timeout only every interval x throttle
            # (10 s x 10 by default): sweep each second, or a dead worker's dispatch waits ~100 s more
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # a broker that takes the connection and never answers (Redis stopped, a partition) fails a publish
            # in seconds: without these, an API request's enqueue blocked for good, holding its tenant's slot
            "socket_timeout": BROKER_TIMEOUT_S,
            "socket_connect_timeout": BROKER_TIMEOUT_S,
        },
        broker_connection_timeout=BROKER_TIMEOUT_S,
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1},
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
    )
    from prfaas.control_plane.billing.tasks import configure

    configure(app, settings, worker=worker)  # beat: price refresh, ledger reconciliation
    if worker:
        _worker_side(app, settings)
    return app


def _worker_side(app: Celery, settings: Settings) -> None:
    from celery.signals import worker_init, worker_shutdown

    from prfaas.control_plane.jobs.dispatch import Dispatcher
    from prfaas.control_plane.jobs.leases import Heartbeats
    from prfaas.control_plane.jobs.sweeper import Sweeper
    from prfaas.control_plane.services import Services

    services = Services.create(settings)
    beats = {kind: Heartbeats(services.redis, settings, kind) for kind in ("worker", "api")}  # api: read only
    dispatcher = Dispatcher(services, lambda job_id, countdown: enqueue(app, job_id, countdown), beats["worker"].me)
    adoptions = Adoptions(services, app, beats["worker"].me)
    sweeper = Sweeper(services.jobs, dispatcher.leases, dispatcher.attempts, beats, dispatcher.channels,
                      adoptions.adopt)  # fmt: skip

    @app.task(name=TASK)  # type: ignore[untyped-decorator]
    def dispatch_job(job_id: str) -> str:
        return dispatcher.run(job_id)

    @worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
    def _started(**_: object) -> None:  # before the first task: its leases' owner must be beating
        beats["worker"].start()
        sweeper.start()

    @worker_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
    def _stopping(**_: object) -> None:  # its streams end with it: say so, and the others sweep at once
        sweeper.stop()
        beats["worker"].stop()


class Adoptions:
    """Jobs this worker follows in place of a dead API process (jobs/sweeper.py), each on a
    thread of its own, into the job's token log; billed at DONE like any other."""

    def __init__(self, services: Any, app: Celery, owner: str) -> None:
        self.s = services
        self.app = app
        self.owner = owner
        self._follower: Any = None

    def adopt(self, job_id: str, stale_attempt: int) -> None:
        import threading

        from prfaas.control_plane.billing.meter import open_meter
        from prfaas.control_plane.jobs.errors import JobEnded
        from prfaas.control_plane.jobs.generation import Follower

        if self._follower is None:
            self._follower = Follower(self.s, self.app, open_meter(self.s), self.owner)
        follower = self._follower
        logged = follower.log.logged_tokens(job_id, 0)

        def follow() -> None:
            try:
                for _ in follower.tokens(job_id, after_attempt=stale_attempt, already=logged):
                    pass
            except JobEnded as exc:
                log.info("adopted job %s ended: %s", job_id, exc)

        threading.Thread(target=follow, name=f"adopted-{job_id[:8]}", daemon=True).start()


def enqueue(app: Celery, job_id: str, countdown_s: float = 0.0) -> Any:
    return app.send_task(TASK, args=[job_id], countdown=countdown_s or None)
