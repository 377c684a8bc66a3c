"""Generate the Python stubs of protos/prfaas/v1/*.proto, or check the committed ones.

    python -m prfaas.protos.generate           # write protos/prfaas/v1/*_pb2*.py(i)
    python -m prfaas.protos.generate --check   # exit 1 if the committed stubs are stale

Messages get `*_pb2.py` + typed `*_pb2.pyi` (mypy-protobuf), services `*_pb2_grpc.py` +
`*_pb2_grpc.pyi`. protoc writes imports as `from prfaas.v1 import ...`; installed, the
stubs live under `prfaas.protos.prfaas.v1`, so imports are rewritten to that.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent  # the protos/ folder
PROTO_DIR = ROOT / "prfaas" / "v1"
IMPORT = re.compile(r"^(from|import) prfaas\.v1\b", re.MULTILINE)


def _generate(out: Path) -> None:
    from grpc_tools import protoc

    plugin_dir = Path(sys.executable).parent
    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={plugin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={plugin_dir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out}", f"--mypy_grpc_out={out}", *protos,
    ]  # fmt: skip
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in (out / "prfaas" / "v1").iterdir():
        if path.suffix in (".py", ".pyi"):
            path.write_text(IMPORT.sub(r"\1 prfaas.protos.prfaas.v1", path.read_text()))


def _stubs(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.glob("*_pb2*.py*"))}


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _generate(out)
        fresh = _stubs(out / "prfaas" / "v1")
        if check:
            committed = _stubs(PROTO_DIR)
            stale = sorted(n for n in fresh.keys() | committed.keys() if fresh.get(n) != committed.get(n))
            if stale:
                print(f"generated stubs are stale: {', '.join(stale)}; run `python -m prfaas.protos.generate`")
                return 1
            print(f"protos: {len(fresh)} generated stubs match")
            return 0
        for name in _stubs(PROTO_DIR):
            (PROTO_DIR / name).unlink()
        for name in fresh:
            shutil.copyfile(out / "prfaas" / "v1" / name, PROTO_DIR / name)
        print(f"protos: wrote {len(fresh)} stubs to {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
