"""What the benchmarks that bring up a whole deployment share (bench/chaos.py, bench/soak.py,
bench/link_shift.py): a deployment of their own, as `prfaas up` starts it (devstack/deployment.py),
in a fresh home; and the options of a steady load (loadgen/steady.py), with the argparse types that
refuse values that would send nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from prfaas.devstack.deployment import Deployment
from prfaas.devstack.topology import Topology, write_topology


def fresh_deployment(topology: Topology, emulate_wan: bool, say: Callable[[str], None], *, prefix: str) -> Deployment:
    """A deployment of `topology` (not started) in a new temporary home, `prefix` its name's start, that
    holds its topology file and its ledger (PRFAAS_LEDGER_URL, set for this process and the ones it starts)."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["PRFAAS_LEDGER_URL"] = f"sqlite:///{home / 'ledger.db'}"
    topology_path = home / "topology.yaml"
    write_topology(topology, topology_path)
    return Deployment(topology, str(topology_path), home, emulate_wan, say)


def positive(text: str) -> float:
    """An argparse type: a finite number above 0 (a rate of 0 sends nothing, and the run "passes")."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def at_least_one(text: str) -> int:
    """An argparse type: a whole number, 1 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {text}")
    return value


def add_steady_load_options(parser: argparse.ArgumentParser) -> None:
    """--rate and --max-tokens of a steady load's requests (refused, exit 2, when they would send nothing)."""
    parser.add_argument("--rate", type=positive, default=2.0, help="requests started per second")
    parser.add_argument("--max-tokens", type=at_least_one, default=16)
