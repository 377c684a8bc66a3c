"""prfaas.control_plane.billing: metering, the usage ledger and prices.

A finished job becomes one ledger entry, exactly once, off the request path; attempts that did not answer
are the platform's cost; budgets are checked against the ledger's monthly spend. Reference: docs/metering.md.

    costs.py        PriceTable, JobUsage and the $ arithmetic of one job (pure)
    usage.py        a job's record and timeline -> its JobUsage and wasted work (pure)
    models.py       the ledger's tables (UsageEntry, WastedAttempt), in the control plane's database (db/)
    ledger.py       Ledger: write entries once, read entries, spend and totals
    queries.py      GroupTotal: totals by day, model, tenant, region or phase
    meter.py        Meter: the `job_done` hook, its writer thread, pricing a job's work
    spend.py        each tenant's monthly spend in Redis (what admission checks budgets against)
    reconcile.py    the sweep: bill what was missed, record wasted attempts, sync spend
    metrics.py      Prometheus series of metering and prices
    prices.py       PriceConfig (YAML table), PriceBook (the Redis cache of prices)
    price_feeds.py  PriceFeed: EC2 spot price history and the AWS Price List, through boto3
    tasks.py        the Celery beat schedule: prfaas.refresh_prices, prfaas.reconcile_ledger
"""
