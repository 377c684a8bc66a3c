"""`celery -A prfaas.control_plane.worker worker`: the Celery app of a worker process, from
the environment's settings (PRFAAS_*)."""

from prfaas.control_plane.jobs.celery_app import make_celery
from prfaas.control_plane.settings import Settings
from prfaas.telemetry import tracing

tracing.configure("prfaas-worker")

app = make_celery(Settings(), worker=True)  # type: ignore[call-arg]
