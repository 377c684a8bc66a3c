"""Cost of one reconciliation sweep (control_plane/billing/reconcile.py) over a busy hour's finished jobs.

    .venv/bin/python bench/reconcile_sweep.py [--jobs 5000] [--baseline OLD_RECONCILE.py] [--json PATH]

Writes `--jobs` finished jobs of one tenant into the local Redis (tests/ensure-services.sh; a scratch key prefix,
deleted after) through the job store's own scripts: 40 % DONE and billed by the meter, 20 % DONE and never billed
(their API process died first), 40 % FAILED after one prefill attempt (one wasted row each). The ledger is a
SQLite file in a temporary folder. Then times two sweeps: the first (bills the unbilled, records the wasted
attempts) and the second (steady state: nothing left to do, what every later minute costs). Counts the Redis
round trips (commands or pipelines sent) and the SQL statements each sweep issues.

`--baseline PATH`: also run the `reconcile` of another version of reconcile.py (e.g. `git show
HEAD:control_plane/billing/reconcile.py > /tmp/old_reconcile.py`) on a data set of its own, in the same run, on
today's meter, ledger and job store. `--json PATH` writes one row per (version, sweep): reconcile, sweep, jobs,
sweep_s, redis_round_trips, sql_queries, written.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
import yaml

from prfaas.control_plane.billing.ledger import Ledger
from prfaas.control_plane.billing.meter import Meter
from prfaas.control_plane.billing.reconcile import reconcile
from prfaas.control_plane.jobs.states import JobState
from prfaas.control_plane.services import Services
from prfaas.control_plane.settings import Settings
from prfaas.control_plane.tenants import Quota

REDIS_URL = "redis://127.0.0.1:6379/0"
QUOTA = Quota(rps=10**9, concurrency=10**9, budget_usd=10**9)
FIELDS = {"model": "tiny-llama", "prompt_tokens": 5, "max_new_tokens": 3}


def load_reconcile(path: Path) -> Callable[[Meter], int]:
    spec = importlib.util.spec_from_file_location("reconcile_baseline", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reconcile


@contextmanager
def scratch(folder: Path) -> Iterator[Services]:
    """Services on a key prefix and a SQLite database of their own; the keys deleted after."""
    prices = folder / "prices.yaml"
    table = {"max_age_s": 3600, "refresh_s": 3600, "regions": {"r": {"usd_per_gpu_hour": 3.6}}}
    prices.write_text(yaml.safe_dump(table))
    prefix = f"prfaas-bench-{uuid.uuid4().hex[:12]}"
    settings = Settings.model_validate({
        "dev": True, "redis_url": REDIS_URL, "key_prefix": prefix, "admin_key": "bench-admin-key-0123456789abcdef",
        "ticket_key": "bench-ticket-key-0123456789abcdef", "ledger": {"url": f"sqlite:///{folder / 'ledger.db'}"},
        "prices": {"path": str(prices)},
    })  # fmt: skip
    services = Services.create(settings)
    try:
        yield services
    finally:
        keys = list(services.redis.scan_iter(f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 1000):
            services.redis.delete(*keys[i : i + 1000])
        services.close()


def fill(services: Services, meter: Meter, num_jobs: int) -> None:
    """The mix of the module docstring, in the window of the next sweep."""
    jobs, tenant = services.jobs, services.tenants.create("bench").id
    billed = []
    for i in range(num_jobs):
        job = jobs.create(tenant, FIELDS, QUOTA).job_id
        if i % 5 in (0, 1, 2):  # DONE: 2 of 3 billed
            jobs.update(job, 1, placement_chosen="local", decode_region="r")
            jobs.transition(job, JobState.LOCAL, 1, note="local in r")
            jobs.transition(job, JobState.DONE, 1, completion_tokens=3, gen_first_s=0.2, gen_last_s=0.4)
            if i % 5 != 2:
                billed.append(job)
        else:  # FAILED: the prefill attempt held r's GPU from PREFILLING to FAILED
            jobs.update(job, 1, placement_chosen="split", regions_a1="r>r")
            jobs.transition(job, JobState.PREFILLING, 1, note="prefill in r")
            jobs.transition(job, JobState.FAILED, 1, note="prefill in r: UNAVAILABLE")
    for i in range(0, len(billed), 500):
        meter.bill_many(billed[i : i + 500])


@contextmanager
def counted(engine: sa.Engine) -> Iterator[dict[str, int]]:
    """Redis round trips (each command or pipeline sent) and SQL statements, while inside."""
    counts = {"redis_round_trips": 0, "sql_queries": 0}
    send = redis.connection.AbstractConnection.send_packed_command

    def sending(conn: Any, command: Any, check_health: bool = True) -> None:
        counts["redis_round_trips"] += 1
        send(conn, command, check_health)  # type: ignore[no-untyped-call]

    def executing(*_: Any) -> None:
        counts["sql_queries"] += 1

    redis.connection.AbstractConnection.send_packed_command = sending  # type: ignore[method-assign]
    sa.event.listen(engine, "before_cursor_execute", executing)
    try:
        yield counts
    finally:
        redis.connection.AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        sa.event.remove(engine, "before_cursor_execute", executing)


def run(name: str, sweep: Callable[[Meter], int], num_jobs: int) -> list[dict[str, Any]]:
    folder = Path(tempfile.mkdtemp(prefix="prfaas-bench-"))
    rows = []
    try:
        with scratch(folder) as services:
            ledger = Ledger(services.settings.ledger.url, engine=services.database, migrate=False)
            meter = Meter(services, ledger)
            started = time.perf_counter()
            fill(services, meter, num_jobs)
            print(f"{name}: {num_jobs} jobs written in {time.perf_counter() - started:.1f} s", flush=True)
            for which in ("first", "steady"):
                with counted(services.database) as counts:
                    started = time.perf_counter()
                    written = sweep(meter)
                    sweep_s = time.perf_counter() - started
                row = {"reconcile": name, "sweep": which, "jobs": num_jobs, "sweep_s": round(sweep_s, 3), **counts}
                rows.append(row | {"written": written})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=5000, help="finished jobs in the sweep's window")
    parser.add_argument("--baseline", type=Path, help="another reconcile.py to run too, on a data set of its own")
    parser.add_argument("--json", type=Path, help="write one row per (version, sweep) here")
    args = parser.parse_args(argv)
    rows = []
    if args.baseline:
        rows += run("baseline", load_reconcile(args.baseline), args.jobs)
    rows += run("current", reconcile, args.jobs)
    print(f"{'reconcile':>9} {'sweep':>7} {'jobs':>6} {'sweep s':>8} {'redis trips':>11} {'sql':>6} {'written':>7}")
    for r in rows:
        print(f"{r['reconcile']:>9} {r['sweep']:>7} {r['jobs']:>6} {r['sweep_s']:>8.3f} {r['redis_round_trips']:>11}"
              f" {r['sql_queries']:>6} {r['written']:>7}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
