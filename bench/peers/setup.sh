#!/usr/bin/env bash
# Peer transfer libraries for the KV transport benchmarks, in their own venv (.venv-peers).
# Never a dependency of prfaas: bench/transport_loopback.py and bench/transport_wan.py --peers
# run bench/peers/peer_bench.py under this venv's python in subprocesses.
#
#   bash bench/peers/setup.sh            # idempotent; PYTHON=python3.11 VENV=.venv-peers by default
#
# Mooncake: mooncake-transfer-engine-non-cuda (the plain wheel needs CUDA and the driver);
#           it links libibverbs/librdmacm even for TCP, hence the apt packages.
# NIXL:     nixl-cu12 with --no-deps (its deps pull CUDA wheels); run it with
#           UCX_TLS=tcp UCX_MODULES=^ib (peer_bench.py sets both).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-peers}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
MOONCAKE_PKG="${MOONCAKE_PKG:-mooncake-transfer-engine-non-cuda}"
NIXL_PKG="${NIXL_PKG:-nixl-cu12}"
APT_PKGS=(libibverbs1 librdmacm1 ibverbs-providers)

missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup.sh: installing ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
if ! "$PY" -c "import numpy, mooncake.engine, nixl_cu12._api" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet numpy "$MOONCAKE_PKG"
    "$PY" -m pip install --quiet --no-deps "$NIXL_PKG"
fi
# xxhash is optional (faster checksum); blake2b from hashlib is the fallback
"$PY" -c "import xxhash" >/dev/null 2>&1 || "$PY" -m pip install --quiet xxhash || true

UCX_TLS=tcp UCX_MODULES=^ib "$PY" - <<'PY'
import importlib.metadata as md

from mooncake.engine import TransferEngine  # noqa: F401
from nixl_cu12._api import nixl_agent  # noqa: F401

print("peers ready:", ", ".join(f"{p} {md.version(p)}" for p in ("mooncake-transfer-engine-non-cuda", "nixl-cu12", "numpy")))
PY
