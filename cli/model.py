"""`prfaas model ...`: the offline model catalog's commands (thin: engine/models.py and
engine/calibration.py do the work)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from prfaas.engine.errors import EngineError

console = Console()

model_app = typer.Typer(help="Prepare and list the offline model catalog.", no_args_is_help=True)


def quiet_transformers() -> None:
    """Load transformers offline and silent (no hub calls, no progress bars, errors only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


@model_app.command("list")
def model_list() -> None:
    """List catalog models and whether they are prepared."""
    from prfaas.engine.models import list_models, models_root

    table = Table("name", "prepared", "sha256", "description", "source")
    for status in list_models():
        prepared = "yes" if status.prepared else "no"
        table.add_row(status.name, prepared, (status.checksum or "-")[:12], status.description, status.source)
    console.print(table)
    console.print(f"model cache: {models_root()}")


def _each_model(
    names: list[str], step: Callable[[str], str], errors: tuple[type[Exception], ...], *, name_errors: bool = False
) -> None:
    """Run an idempotent `step` on each model in turn and print the line it returns; the first of `errors`
    is printed (after the model's name with `name_errors`) and exits 2."""
    quiet_transformers()
    for name in names:
        try:
            done = step(name)
        except errors as exc:
            console.print(f"[red]error:[/red] {escape(f'{name}: ' if name_errors else '')}{escape(str(exc))}",
                          highlight=False, soft_wrap=True)  # fmt: skip
            raise typer.Exit(2) from None
        console.print(done, soft_wrap=True)


@model_app.command("prepare")
def model_prepare(
    names: list[str] = typer.Argument(..., help="catalog model names (see `prfaas model list`)"),
    force: bool = typer.Option(False, help="rebuild even if an intact copy exists"),
) -> None:
    """Build models into $PRFAAS_HOME/models from local sources (idempotent)."""
    from prfaas.engine.models import prepare_model

    def prepare(name: str) -> str:
        prepared = prepare_model(name, force=force)
        verb = "kept" if prepared.reused else "prepared"
        return f"{verb} {prepared.name} at {prepared.path} (sha256 {prepared.checksum[:16]}...)"

    _each_model(names, prepare, (EngineError,))


@model_app.command("calibrate")
def model_calibrate(
    models: list[str] = typer.Argument(..., help="catalog names (prepared) or HF model folders"),
    force: bool = typer.Option(False, help="measure again even if stored"),
) -> None:
    """Measure each model's query energy per key channel, which the kv codecs shape key scales by, into
    $PRFAAS_HOME/calibration (idempotent; a prefill region loads it by the model's fingerprint)."""
    from prfaas.engine.calibration import calibrate
    from prfaas.engine.models import resolve_model

    def measure(model: str) -> str:
        path, measured = calibrate(resolve_model(model), force=force)
        return f"{'measured' if measured else 'kept'} the query energy of {model} at {path}"

    _each_model(models, measure, (EngineError, RuntimeError), name_errors=True)


def prepare_for_up(topology: str, model: str) -> None:
    """Build the topology's catalog model when this home lacks it, before `prfaas up` starts anything; an
    unknown model or a failed build is one line and exit status 2."""
    from prfaas.engine.models import models_root, prepare_model, unprepared

    try:
        missing = unprepared(model)
        if missing is None:
            return
        quiet_transformers()
        with _building(f"preparing model {missing} in {models_root()}"):
            prepared = prepare_model(missing)
    except EngineError as exc:
        console.print(f"[red]error:[/red] topology {escape(repr(topology))}: model: {escape(str(exc))}",
                      highlight=False, soft_wrap=True)  # fmt: skip
        raise typer.Exit(2) from None
    console.print(f"prepared {prepared.name} at {prepared.path} (sha256 {prepared.checksum[:16]}...)", soft_wrap=True)


@contextlib.contextmanager
def _building(what: str, every_s: float = 20.0) -> Iterator[None]:
    """A spinner and a bar on a terminal while the block runs; elsewhere (a log, CI), which shows no bar, a
    line as it starts and one every `every_s` seconds, so a minute's build is never a minute of silence."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    if console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:  # fmt: skip
            bar.add_task(f"{what} (first run only)", total=None)
            yield
        return
    console.print(f"{what} (first run only)", highlight=False, soft_wrap=True)
    started, done = time.monotonic(), threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            console.print(f"{what}: {time.monotonic() - started:.0f} s", highlight=False, soft_wrap=True)

    thread = threading.Thread(target=beat, name="prepare-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
