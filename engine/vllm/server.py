"""A `VLLMHost` in its own process, driven over a loopback control socket.

vLLM keeps process-wide state (its KV transfer group, its parallel groups), so two vLLM
engines need two processes; this is how tests and benchmarks run a prefill engine and a
decode engine side by side, and how a region with `engine: vllm` runs its engine (the
region's own environment has no vLLM; `engine/vllm/remote.py` starts this server with the
vLLM environment's python). The control channel is `multiprocessing.connection` (HMAC
challenge with the authkey in `PRFAAS_VLLM_AUTHKEY`, hex), one call per connection;
`stream` sends the tokens as they are generated and aborts the request when the caller
closes the connection. With `--exit-with-parent` (regions pass it) the server exits when
the process that started it goes away.

    PRFAAS_VLLM_AUTHKEY=<hex> python -m prfaas.engine.vllm.server --model smollm2-135m --ticket-key k1:<hex>

writes `{"control": [host, port], "kv": [host, port]}` to `--ready-file` when ready (vLLM
logs to stdout, so the file is the one thing a launcher has to read). `--tls-cert`,
`--tls-key`, `--tls-ca` (paths) put the KV port and the outbound KV channels on mutual TLS.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import queue
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Generator
from dataclasses import asdict
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from pathlib import Path
from threading import Event
from typing import TYPE_CHECKING, Any, Unpack

from prfaas.engine.vllm.params import GenerateOptions
from prfaas.transport.tls import NodeCert

if TYPE_CHECKING:
    from prfaas.engine.vllm.host import VLLMHost

AUTHKEY_ENV = "PRFAAS_VLLM_AUTHKEY"
TICKET_KEYS_ENV = "PRFAAS_VLLM_TICKET_KEYS"  # kid:hexkey[,kid:hexkey...]: keys off the command line
# expect, forget, free_blocks, cancel_shipment: calls that do no compute; also the most any call's connect, handshake
# and request send may take (a server that cannot answer its challenge in this long is stalled, not busy)
CONTROL_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """The server raised; the message names the server-side exception."""


class StreamStopped(RuntimeError):
    """`VLLMClient.stream` ended by its `stop` event (the request was aborted)."""


def _no_delay(conn: Connection) -> Connection:
    """TCP_NODELAY on a control connection: its handshake and its small request and reply
    messages otherwise wait on Nagle's algorithm against delayed ACKs (measured: 43 ms a
    call on loopback, every call)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _io_timeout(conn: Connection, seconds: float) -> None:
    """SO_RCVTIMEO and SO_SNDTIMEO on the connection's socket: a read or a write that waits longer fails
    (EAGAIN). `Connection` reads and writes the descriptor itself, so a Python socket timeout cannot do it."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, max(int((seconds - whole) * 1e6), 0 if whole else 1))  # 0, 0: no timeout
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _recv(conn: Connection) -> Any:
    """A reply that `poll` said had started: one that stalls past the socket's timeout (`_connect`) is a
    TimeoutError (the engine's WorkerTimeout), not the BlockingIOError SO_RCVTIMEO raises."""
    try:
        return conn.recv()
    except BlockingIOError:
        raise TimeoutError(f"a vLLM server's reply stalled for {CONTROL_TIMEOUT_S:.0f} s") from None


def _connect(address: tuple[str, int], authkey: bytes, request: Any, timeout_s: float) -> Connection:
    """`Client(address, authkey=...)` then `send(request)`, all within `timeout_s` (at most CONTROL_TIMEOUT_S):
    a server process alive but stalled (its listen backlog takes the connection, nobody answers the challenge)
    is a TimeoutError, not a wait forever. Each step (connect, the two challenges, the send) gets the time left
    when it starts. TCP_NODELAY is set before the handshake; afterwards a read or write of the reply waits at
    most CONTROL_TIMEOUT_S (a reply that started and stalls), `poll` bounds the wait for it to start."""
    budget_s = min(timeout_s, CONTROL_TIMEOUT_S)
    deadline = time.monotonic() + budget_s
    stalled = f"vLLM server at {address} did not answer in {budget_s:.3g} s"
    sock = socket.create_connection(address, timeout=budget_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)  # the descriptor blocking again: `Connection` expects it, SO_RCVTIMEO bounds it
    conn = Connection(sock.detach())

    def bound() -> None:  # the next step gets the time left
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(stalled)
        _io_timeout(conn, left)

    try:
        try:
            bound()
            answer_challenge(conn, authkey)
            bound()
            deliver_challenge(conn, authkey)
            bound()
            conn.send(request)
        except BlockingIOError:  # SO_RCVTIMEO / SO_SNDTIMEO ran out
            raise TimeoutError(stalled) from None
        _io_timeout(conn, CONTROL_TIMEOUT_S)
    except BaseException:
        conn.close()
        raise
    return conn


def _serve_one(host: Any, conn: Connection, authkey: bytes) -> None:
    from prfaas.engine.vllm.params import ShipParams

    try:
        try:  # on this connection's thread: a peer that stalls the handshake holds only it
            deliver_challenge(_no_delay(conn), authkey)
            answer_challenge(conn, authkey)
        except multiprocessing.AuthenticationError:
            return  # closed below
        op, args = conn.recv()
        try:
            if op == "stream":
                _stream(host, conn, *args)
                return
            if op == "generate":
                token_ids, max_tokens, kv_params, timeout_s, sampling = args
                options = GenerateOptions(kv_params=kv_params, timeout_s=timeout_s, sampling=sampling)
                result: Any = asdict(host.generate(token_ids, max_tokens, **options))
            elif op == "expect":
                job_id, attempt, timeout_s, tenant, max_bytes = args
                host.link.expect(job_id, attempt, timeout_s, tenant=tenant, max_bytes=max_bytes)
                result = None
            elif op == "forget":
                job_id, attempt = args
                result = host.link.forget(job_id, attempt)
            elif op == "free_blocks":
                result = host.num_free_blocks()
            elif op == "wait_shipped":
                kv_params, timeout_s = args
                outcome = host.wait_shipped(ShipParams.parse(kv_params["prfaas_ship"]), timeout_s)
                result = None if outcome is None else {**asdict(outcome), "status": outcome.status.value}
            elif op == "cancel_shipment":
                (kv_params,) = args
                result = host.cancel_shipment(ShipParams.parse(kv_params["prfaas_ship"]))
            else:
                raise ValueError(f"unknown operation {op!r}")
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except (EOFError, OSError):
        pass
    finally:
        conn.close()


def _stream(host: Any, conn: Connection, token_ids: list[int], max_tokens: int, kv_params: Any,
            timeout_s: float, sampling: dict[str, Any] | None) -> None:  # fmt: skip
    """Send ("steps", new steps) as they come (engine/vllm/sampling.py `Step`), then ("ok",
    generation); abort the request when the caller closes the connection (or sends
    anything) or `timeout_s` passes."""
    updates: queue.Queue[list[Any]] = queue.Queue()
    request_id = f"s-{uuid.uuid4().hex}"
    future = host.submit(token_ids, max_tokens, kv_params, request_id=request_id, on_tokens=updates.put,
                         sampling=sampling)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    sent = 0
    try:
        while not future.done() or not updates.empty():
            if not future.done() and time.monotonic() > deadline:  # also while tokens keep coming
                host.abort(request_id)
                raise TimeoutError(f"generation did not finish in {timeout_s} s")
            try:
                steps = updates.get(timeout=0.05)
            except queue.Empty:
                if conn.poll(0):  # EOF: the caller went away
                    host.abort(request_id)
                    return
                continue
            conn.send(("steps", steps))
            sent += len(steps)
        result = asdict(future.result())
        ids, logprobs = result["token_ids"], result["logprobs"]
        rest = [(ids[i], logprobs[i] if logprobs else None, result["prompt_logprobs"] if i == 0 else None)
                for i in range(sent, len(ids))]  # fmt: skip
        if rest:
            conn.send(("steps", rest))
        conn.send(("ok", result))
    except OSError:  # the caller's end is gone
        host.abort(request_id)
        raise


def _exit_with_parent() -> None:
    """A server whose launcher died (even by SIGKILL) must not hold a core and its KV cache."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def serve(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prfaas.engine.vllm.server")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-host", default="127.0.0.1")
    parser.add_argument("--kv-port", type=int, default=0)
    parser.add_argument("--control-host", default="127.0.0.1", help="where the control socket listens")
    parser.add_argument("--control-port", type=int, default=0)
    parser.add_argument("--node", default="vllm")
    parser.add_argument(
        "--ticket-key", action="append", default=[], help=f"kid:hexkey (repeatable; or {TICKET_KEYS_ENV})"
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn vLLM's automatic prefix caching off")
    parser.add_argument("--query-energy", type=Path, help="the model's calibration (kvw6's and kvw4's key steps)")
    parser.add_argument("--fingerprint", default="", help="the model's fingerprint, which --query-energy must carry")
    for part in ("cert", "key", "ca"):  # paths, never the key itself on a command line
        parser.add_argument(f"--tls-{part}", type=Path, help="KV over mutual TLS: this node's certificate, key, CA")
    parser.add_argument(
        "--kv-transfer-config", type=json.loads, help="JSON: another KV connector instead of prfaas's (benchmarks)"
    )
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process does")
    ns = parser.parse_args(argv)
    authkey = bytes.fromhex(os.environ.get(AUTHKEY_ENV, ""))
    if len(authkey) < 16:
        parser.error(f"{AUTHKEY_ENV} must hold at least 16 bytes of hex")
    keys = {}
    for item in ns.ticket_key + [x for x in os.environ.get(TICKET_KEYS_ENV, "").split(",") if x]:
        kid, _, hexkey = item.partition(":")
        keys[kid] = bytes.fromhex(hexkey)

    tls_files = (ns.tls_cert, ns.tls_key, ns.tls_ca)
    if any(tls_files) and not all(tls_files):
        parser.error("--tls-cert, --tls-key and --tls-ca go together")
    tls = NodeCert(ns.tls_cert, ns.tls_key, ns.tls_ca) if all(tls_files) else None

    if ns.exit_with_parent:
        threading.Thread(target=_exit_with_parent, name="vllm-server-parent", daemon=True).start()
    from prfaas.engine.vllm.host import VLLMHost

    host = VLLMHost(
        ns.model,
        dtype=ns.dtype,
        max_model_len=ns.max_model_len,
        ticket_keys=keys or None,
        kv_host=ns.kv_host,
        kv_port=ns.kv_port,
        node=ns.node,
        enforce_eager=ns.enforce_eager,
        kv_transfer_config=ns.kv_transfer_config,
        tls=tls,
        prefix_caching=not ns.no_prefix_caching,
        query_energy=(ns.query_energy, ns.fingerprint) if ns.query_energy else None,
    )
    threading.Thread(target=_exit_when_dead, args=(host,), name="vllm-server-engine-watch", daemon=True).start()
    listener = Listener((ns.control_host, ns.control_port))  # authenticated per connection (_serve_one)
    ready = {"control": list(listener.address), "kv": list(host.kv_address or ())}
    tmp = f"{ns.ready_file}.tmp"
    with open(tmp, "w") as fh:
        json.dump(ready, fh)
    os.replace(tmp, ns.ready_file)  # atomic: a launcher never reads half a file
    try:
        while True:
            try:
                conn = listener.accept()
            except OSError:  # the listener closed
                continue
            threading.Thread(target=_serve_one, args=(host, conn, authkey), daemon=True).start()
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()
        host.close()


EXIT_ENGINE_DIED = 3


def _exit_when_dead(host: VLLMHost) -> None:
    """A server whose engine died answers every call with an error: exit instead, so the region sees the
    server gone (remote.py `on_exit`) and leaves the fleet, rather than heartbeat on and fail each job."""
    host.died.wait()
    log.critical("the vLLM engine died (%r): exiting with %d", host.failure, EXIT_ENGINE_DIED)
    logging.shutdown()
    os._exit(EXIT_ENGINE_DIED)


class VLLMClient:
    """Calls on a `vllm_server` process; every call has a deadline."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        self.address = address
        self._authkey = authkey

    def _call(self, op: str, args: Any, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        conn = _connect(self.address, self._authkey, (op, args), timeout_s)
        try:
            if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"vLLM server gave no answer to {op} in {timeout_s} s")
            status, result = _recv(conn)
        finally:
            conn.close()
        if status != "ok":
            raise RemoteError(result)
        return result

    def stream(
        self, token_ids: list[int], max_tokens: int, stop: Event | None = None, **options: Unpack[GenerateOptions]
    ) -> Generator[list[Any], None, dict[str, Any]]:
        """Yields each step's new tokens as `Step`s (token id, logprobs, prompt logprobs on the
        first: engine/vllm/sampling.py); returns what `generate` returns. `sampling`: kwargs of
        vLLM's SamplingParams (None: greedy, EOS ignored). Closing the generator early aborts the
        request on the server; so does `stop` (checked every 0.1 s, also while vLLM waits for a
        shipment), which raises `StreamStopped`. `timeout_s`: 300 s by default."""
        timeout_s = options.get("timeout_s", 300.0)
        deadline = time.monotonic() + timeout_s + 5
        if stop is not None and stop.is_set():
            raise StreamStopped("stopped by the caller")
        request = ("stream", (token_ids, max_tokens, options.get("kv_params"), timeout_s, options.get("sampling")))
        conn = _connect(self.address, self._authkey, request, timeout_s + 5)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"vLLM server did not finish the generation in {timeout_s} s")
                if stop is not None and stop.is_set():
                    raise StreamStopped("stopped by the caller")
                if not conn.poll(min(remaining, 0.1)):
                    continue
                status, payload = _recv(conn)
                if status == "steps":
                    yield list(payload)
                elif status == "ok":
                    return dict(payload)
                else:
                    raise RemoteError(payload)
        finally:
            conn.close()

    def generate(self, token_ids: list[int], max_tokens: int, **options: Unpack[GenerateOptions]) -> dict[str, Any]:
        """-> {"token_ids", "kv_transfer_params", "num_cached_tokens", "seconds", "first_token_at",
        "logprobs", "prompt_logprobs"} (`first_token_at`: the server's time.monotonic(),
        comparable on the same host; logprobs as engine/vllm/sampling.py's WireLogprobs); `timeout_s`: 300 s by
        default"""
        timeout_s = options.get("timeout_s", 300.0)
        args = (token_ids, max_tokens, options.get("kv_params"), timeout_s, options.get("sampling"))
        result: dict[str, Any] = self._call("generate", args, timeout_s + 5)
        return result

    def expect(
        self, job_id: str, attempt: int, timeout_s: float, *, tenant: str | None = None, max_bytes: int | None = None
    ) -> None:
        """Register a shipment before its prefill starts (the decode region's reservation: an
        OPEN for another tenant, or past `max_bytes`, is refused: `Receiver.expect`)."""
        self._call("expect", (job_id, attempt, timeout_s, tenant, max_bytes), 30.0)

    def forget(self, job_id: str, attempt: int) -> bool:
        """Drop a registered shipment no request took (the reservation ended)."""
        return bool(self._call("forget", (job_id, attempt), 30.0))

    def num_free_blocks(self, timeout_s: float = 30.0) -> int:
        return int(self._call("free_blocks", None, timeout_s))

    def wait_shipped(self, kv_params: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        result: dict[str, Any] | None = self._call("wait_shipped", (kv_params, timeout_s), timeout_s + 5)
        return result

    def cancel_shipment(self, kv_params: dict[str, Any], timeout_s: float = 30.0) -> bool:
        """Cancel the outbound shipment of the request these `prfaas_ship` params named (its job ended):
        idempotent, harmless once it ended or if it never started; True if one was in flight."""
        return bool(self._call("cancel_shipment", (kv_params,), timeout_s))


if __name__ == "__main__":
    serve(sys.argv[1:])
