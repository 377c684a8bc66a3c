"""The NIXL and Mooncake adapters up to the library boundary. Neither library is a prfaas
dependency: in the main environment an adapter must fail with an error naming the package;
in the peers' environment (bench/peers/setup.sh, when present) each adapter moves bytes
with a real one-sided WRITE over TCP, checked byte for byte."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from prfaas.transport.errors import TransportError
from prfaas.transport.rdma import check_range, engine_for

REPO = Path(__file__).resolve().parents[2]
PEERS_PYTHON = Path(os.environ.get("PRFAAS_PEERS_PYTHON", REPO / ".venv-peers" / "bin" / "python"))
MODULES = {"mooncake": "mooncake", "nixl": "nixl_cu12"}

SCRIPT = """
import numpy as np, sys
from prfaas.transport.rdma import engine_for
kind = sys.argv[1]
target = engine_for(kind, np.zeros(1 << 20, np.uint8))
source = engine_for(kind, np.frombuffer(np.random.default_rng(3).bytes(1 << 20), np.uint8).copy())
source.connect(target.info())
source.write(4096, 8192, 65536, 30.0)
assert bytes(target.buf[8192:8192 + 65536]) == bytes(source.buf[4096:4096 + 65536]), "bytes differ"
assert not target.buf[:8192].any() and not target.buf[8192 + 65536:].any(), "wrote outside the range"
source.close(); target.close()
print("ok", flush=True)
"""


@pytest.mark.parametrize("kind", ["mooncake", "nixl"])
def test_a_missing_library_is_a_transport_error_naming_the_package(kind: str) -> None:
    if importlib.util.find_spec(MODULES[kind]) is not None:
        pytest.skip(f"{MODULES[kind]} is installed here")
    with pytest.raises(TransportError, match=kind):
        engine_for(kind, np.zeros(4096, np.uint8))


@pytest.mark.parametrize(("offset", "nbytes"), [(-1, 10), (0, 4097), (4000, 97), (10, -1)])
def test_a_write_past_the_registered_buffer_is_refused(offset: int, nbytes: int) -> None:
    """The adapters' writes read `nbytes` from the buffer's address plus `offset`: past its end is the
    process's other memory, sent to the peer."""
    check_range(np.zeros(4096, np.uint8), 4096 - 10, 10)
    with pytest.raises(ValueError, match="do not lie in the 4096-byte buffer"):
        check_range(np.zeros(4096, np.uint8), offset, nbytes)


def test_an_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        engine_for("infiniband-magic", np.zeros(4096, np.uint8))


@pytest.mark.parametrize("kind", ["mooncake", "nixl"])
def test_one_sided_write_through_the_library(kind: str, tmp_path: Path) -> None:
    if not PEERS_PYTHON.exists():
        pytest.skip("no peers environment (bash bench/peers/setup.sh)")
    (tmp_path / "prfaas").mkdir()
    (tmp_path / "prfaas" / "transport").symlink_to(REPO / "transport")  # rdma.py needs only errors.py
    env = dict(os.environ, PYTHONPATH=str(tmp_path), UCX_TLS="tcp", UCX_MODULES="^ib")
    result = subprocess.run(
        [str(PEERS_PYTHON), "-c", SCRIPT, kind], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
