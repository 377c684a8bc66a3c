"""prfaas.control_plane: the control plane of prfaas. Its parts (each sub-package's `__init__` maps its
modules):

    scheduling/  the global scheduler: pure filter -> score -> pick policies over a frozen
                 ClusterSnapshot; its public surface is `prfaas.control_plane.scheduling`
    jobs/        a job's life: the state machine, the Redis job store, admission placement,
                 Celery dispatch and retries, the API's side of a running job
    fleet/       the regions: registry (registrations, heartbeats, links, snapshots) and its gRPC service
    billing/     metering: the usage ledger, what each job costs, prices and their feeds, spend
    tenants/     tenants, quotas, budgets and API keys: the database's truth, Redis's cache of it
    db/          the control plane's SQL database (ledger and tenants): engine, base, migrations
    api/         the HTTP API: one router per resource, its dependencies and schemas
    dashboard/   the web dashboard (tenant and admin views)

At the top: the two processes, `app.py` (the API process: `create_app(settings)`) and `worker.py`
(a Celery worker); `settings.py` (the one `Settings`, env prefix PRFAAS_); `services.py` (what both
processes share: the stores, the served model's tokenizer, the schedulers). Dependencies point one
way: scheduling imports nothing else of the control plane.
"""
