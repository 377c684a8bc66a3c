"""The Celery application (Redis broker): `dispatch_job(job_id)`, `acks_late` and
requeued when its worker dies, so another worker finishes the job. A worker process:

    PRFAAS_ADMIN_KEY=... PRFAAS_TICKET_KEY=... celery -A prfaas.control_plane.worker worker
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from prfaas.control_plane.settings import Settings

TASK = "prfaas.dispatch_job"


def make_celery(settings: Settings, *, worker: bool = False) -> Celery:
    app = Celery("prfaas", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=settings.key("dispatch"),
        # kombu sweeps for unacked messages past visibility_timeout only every interval x throttle
        # (10 s x 10 by default): sweep each second, or a dead worker's dispatch waits ~100 s more
        broker_transport_options={
            "visibility_timeout": settings.dispatch_visibility_s,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
    )
    from prfaas.control_plane.billing.tasks import configure

    configure(app, settings, worker=worker)  # beat: price refresh, ledger reconciliation
    if worker:
        from prfaas.control_plane.jobs.dispatch import Dispatcher
        from prfaas.control_plane.services import Services

        dispatcher = Dispatcher(Services.create(settings))

        @app.task(name=TASK)  # type: ignore[untyped-decorator]
        def dispatch_job(job_id: str) -> str:
            return dispatcher.run(job_id)

    return app


def enqueue(app: Celery, job_id: str) -> Any:
    return app.send_task(TASK, args=[job_id])
