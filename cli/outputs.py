"""Where a command writes its results (`--json`, `--png`, `--out`), checked before the work starts: a path
that cannot be written is exit 2 naming the option at once, not after a run of minutes that is then lost."""

from __future__ import annotations

import tempfile
from pathlib import Path


class OutputError(ValueError):
    """An output path that cannot be written; the message names the option and the path."""


def output_file(path: Path, option: str) -> Path:
    """`path`, its folder created, once a file can be written there (an existing file is left as it is)."""
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a folder; give a file name")
    if path.parent.exists() and not path.parent.is_dir():
        raise OutputError(f"{option} {path}: {path.parent} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with path.open("ab"):  # writable, unchanged
                pass
        else:
            with path.open("xb"):
                pass
            path.unlink()  # only the run's result creates it
    except OSError as exc:
        raise OutputError(f"{option} {path}: {exc.strerror or exc}") from None
    return path


def output_folder(path: Path, option: str) -> Path:
    """`path`, created, once files can be written in it."""
    if path.exists() and not path.is_dir():
        raise OutputError(f"{option} {path}: is a file; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise OutputError(f"{option} {path}: {exc.strerror or exc}") from None
    return path


def out_and_json(out: Path | None, json_path: Path | None) -> None:
    """A run's `--out` folder and `--json` file (either may be None), checked before the run (OutputError)."""
    if out is not None:
        output_folder(out, "--out")
    if json_path is not None:
        output_file(json_path, "--json")


def chart_file(path: Path, option: str) -> Path:
    """The file matplotlib writes for `path` (no suffix: it appends `.png`), checked as `output_file`; a suffix
    it has no format for is refused here rather than after the work."""
    from matplotlib.backend_bases import FigureCanvasBase

    if path.is_dir():
        raise OutputError(f"{option} {path}: is a folder; give a file name")
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise OutputError(f"{option} {path}: a chart is one of {', '.join('.' + f for f in sorted(formats))}")
    return output_file(path, option)


def write_failed(path: Path | None, exc: OSError) -> str:
    """The one-line error of a write that failed once the work was done (`path`: where, if `exc` does not say)."""
    return f"cannot write {exc.filename or path}: {exc.strerror or exc}"
