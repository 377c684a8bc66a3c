"""The offline model catalog: `prfaas model list` and `prfaas model prepare NAME`.

Models are built from local sources only (a PyPI package's file, or deterministic code):
nothing is fetched from a model hub. A prepared model is a plain HF folder under
`$PRFAAS_HOME/models/NAME` (default `~/.cache/prfaas`) with a `prfaas-model.json`
manifest recording each file's SHA-256 and a checksum over all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash
from filelock import FileLock

from prfaas.engine.errors import ModelNotPrepared, ModelPrepareError, UnknownModel

MANIFEST = "prfaas-model.json"
# Config keys that describe how a file was written, not what the model computes.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    source: str
    build: Callable[[Path], None]  # writes a complete HF model folder into the given dir


@dataclass(frozen=True)
class ModelStatus:
    name: str
    description: str
    source: str
    path: Path
    prepared: bool
    checksum: str | None


@dataclass(frozen=True)
class PreparedModel:
    name: str
    path: Path
    checksum: str
    reused: bool  # True when an intact earlier preparation was kept


def _catalog() -> dict[str, ModelSpec]:
    # Imported here so `prfaas model list` does not pay for torch/transformers.
    from prfaas.engine import smollm2, tiny

    specs = [
        ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct, real trained weights", smollm2.SOURCE, smollm2.build),
        ModelSpec("tiny-llama", "deterministic random 4-layer Llama for fast tests", tiny.SOURCE, tiny.build),
    ]
    return {spec.name: spec for spec in specs}


def prfaas_home() -> Path:
    return Path(os.environ.get("PRFAAS_HOME") or Path.home() / ".cache" / "prfaas").expanduser()


def models_root() -> Path:
    return prfaas_home() / "models"


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: _file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def _checksum(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _read_manifest(folder: Path) -> dict[str, object] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _verified_checksum(folder: Path) -> str | None:
    """The folder's checksum if its manifest exists and every file still matches it."""
    manifest = _read_manifest(folder)
    if manifest is None:
        return None
    files = _folder_digest(folder)
    if files != manifest.get("files") or _checksum(files) != manifest.get("checksum"):
        return None
    return str(manifest["checksum"])


def list_models(root: Path | None = None) -> list[ModelStatus]:
    root = root or models_root()
    out = []
    for spec in _catalog().values():
        manifest = _read_manifest(root / spec.name)
        checksum = manifest.get("checksum") if manifest else None
        out.append(
            ModelStatus(
                name=spec.name,
                description=spec.description,
                source=spec.source,
                path=root / spec.name,
                prepared=manifest is not None,
                checksum=str(checksum) if checksum else None,
            )
        )
    return out


def prepare_model(name: str, root: Path | None = None, *, force: bool = False) -> PreparedModel:
    """Build catalog model `name` under `root` unless an intact copy is already there.

    Safe to run concurrently (a file lock serializes builders) and after a crash (the
    model is built in a scratch folder and renamed into place only when complete).
    """
    catalog = _catalog()
    if name not in catalog:
        raise UnknownModel(f"unknown model {name!r}; available: {', '.join(sorted(catalog))}")
    if root is None:  # the home, made here when missing, is 0700: `prfaas up` keeps its keys in it too
        prfaas_home().mkdir(mode=0o700, parents=True, exist_ok=True)
        root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    with FileLock(str(root / f".{name}.lock"), timeout=1800):
        if not force and (checksum := _verified_checksum(target)) is not None:
            return PreparedModel(name, target, checksum, reused=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            scratch.chmod(0o755)  # mkdtemp makes it private; the model is not secret
            catalog[name].build(scratch)
            files = _folder_digest(scratch)
            checksum = _checksum(files)
            manifest = {"name": name, "source": catalog[name].source, "files": files, "checksum": checksum}
            (scratch / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            if target.exists():
                shutil.rmtree(target)
            scratch.rename(target)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    return PreparedModel(name, target, checksum, reused=False)


def unprepared(name_or_path: str | Path) -> str | None:
    """The catalog name when `name_or_path` names a catalog model not prepared here yet (what
    `prepare_model` would build); None when it resolves as it is (an HF folder, a prepared
    catalog model). `UnknownModel` when it is neither a folder nor in the catalog."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return None
    name = str(name_or_path)
    if name in _catalog():
        return name if _read_manifest(models_root() / name) is None else None
    raise UnknownModel(
        f"{name!r} is neither a catalog model ({', '.join(sorted(_catalog()))}) nor a folder with a config.json"
    )


def resolve_model(name_or_path: str | Path) -> Path:
    """A model folder from a catalog name (must be prepared) or a path to an HF folder."""
    if (name := unprepared(name_or_path)) is not None:
        raise ModelNotPrepared(f"model {name!r} is not prepared; run `prfaas model prepare {name}`")
    path = Path(name_or_path).expanduser()
    return path if path.is_dir() and (path / "config.json").is_file() else models_root() / str(name_or_path)


def model_fingerprint(folder: Path) -> str:
    """xxh3-128 over the model's config (minus volatile keys) and its weight files' bytes.

    Two folders holding the same computation share a fingerprint; any changed weight or
    architecture field changes it. Independent of the dtype the engine loads it in.
    """
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelPrepareError(f"cannot read {folder / 'config.json'}: {exc}") from None
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    hasher = xxhash.xxh3_128(json.dumps(stable, sort_keys=True).encode())
    weights = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    if not weights:
        raise ModelPrepareError(f"no weight files (*.safetensors, *.bin) in {folder}")
    for path in weights:
        hasher.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(8 << 20):
                hasher.update(chunk)
    return hasher.hexdigest()
