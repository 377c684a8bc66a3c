"""Global scheduler decision latency at fleet scale.

    .venv/bin/python bench/scheduler.py [--regions 10 100 1000] [--workers 1000] [--json PATH]

For each region count: a synthetic snapshot with `--workers` GPU workers in total
(sim/synthetic.py: seeded, so every run sees the same fleets and requests), then
`--requests` decisions with the built-in policy after a warm-up tenth; prints and records
P50 / P99 of one `GlobalScheduler.decide` call (rejections included: they are decisions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prfaas.control_plane.scheduling import build_scheduler
from prfaas.sim.synthetic import latency_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regions", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--workers", type=int, default=1000, help="GPU workers across the fleet")
    parser.add_argument("--requests", type=int, default=2000, help="timed decisions per fleet size")
    parser.add_argument("--json", type=Path, help="write rows {regions, p50_ms, p99_ms} here")
    args = parser.parse_args(argv)
    rows = latency_rows(build_scheduler(), args.regions, num_workers=args.workers, num_requests=args.requests)
    print(f"{'regions':>8} {'workers':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for row in rows:
        print(f"{row['regions']:>8} {args.workers:>8} {row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f}")
    if args.json:
        args.json.write_text(json.dumps([{**row, "workers": args.workers} for row in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
