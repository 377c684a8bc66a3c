"""What the benchmarks that bring up a whole deployment share (bench/chaos.py, bench/soak.py,
bench/link_shift.py): a deployment of their own, as `prfaas up` starts it (devstack/deployment.py),
in a fresh home; and the options of a steady load (loadgen/steady.py).
"""

from __future__ import annotations

import argparse
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


def add_steady_load_options(parser: argparse.ArgumentParser) -> None:
    """--rate and --max-tokens of a steady load's requests."""
    parser.add_argument("--rate", type=float, default=2.0, help="requests started per second")
    parser.add_argument("--max-tokens", type=int, default=16)
