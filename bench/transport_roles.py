"""The receiving process of the two transport benches (transport_loopback.py, transport_wan.py):
a `TcpReceiver` driven by JSON lines on stdin, one JSON reply per command on stdout, and the
certificates both benches use for `--tls`.

    -> {"ready", "port", "tls_port"}                   (tls_port: null without --tls)
    {"op": "expect", "job", "timeout_s", "tls"?}       -> {"ok", "cpu_s"}
    {"op": "cpu"}                                      -> {"cpu_s"}
    {"op": "collect", "job", "timeout_s", "layers"?}   -> {"status", "cpu_s", "digest"}

`cpu_s` is this process's CPU time when the reply's event happened (for collect: when the
shipment ended); `digest` is the xxh3-64 of the first `layers` layers' K and V, when
`layers` is given and the shipment completed, else "". The ticket key comes in
PRFAAS_BENCH_KEY (hex). With certificates (PRFAAS_BENCH_TLS, a folder from `bench_certs`) a
second receiver listens with mutual TLS on `port + 1` (or a free port when `port` is 0), so
one run measures plaintext and TLS side by side; `"tls": true` expects a shipment there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def reply(value: dict[str, Any]) -> None:
    print(json.dumps(value), flush=True)


def hasher() -> Any:
    import xxhash

    return xxhash.xxh3_64()


DECODE, PREFILL = "bench-decode", "bench-prefill"  # the two ends' certificates (and region names)


def bench_certs(directory: Path, addresses: list[str]) -> Path:
    """A CA and a certificate for each end, with identities (a decode region's, a prefill
    region's: the receiver accepts only the latter) and `addresses` as SANs."""
    from prfaas.transport.identity import Identity
    from prfaas.transport.tls import init_certs

    identities = {DECODE: Identity("decode", DECODE, "*"), PREFILL: Identity("prefill", PREFILL, "1")}
    init_certs(directory, list(identities), addresses, identities=identities)
    return directory


def node_cert(directory: str | Path, name: str) -> Any:
    from prfaas.transport.tls import NodeCert

    folder = Path(directory)
    return NodeCert(folder / f"{name}.pem", folder / f"{name}-key.pem", folder / "ca.pem")


def client_tls(directory: str) -> dict[str, Any]:
    """`TcpChannel` options for the sending end: its certificate, and the receiver's server name."""
    from prfaas.transport.identity import server_name
    from prfaas.transport.tls import client_context

    return {"ssl_context": client_context(node_cert(directory, PREFILL)), "server_hostname": server_name(DECODE)}


def serve_receiver(host: str, port: int, sock_buf_bytes: int | None = None) -> None:
    """Listen on (host, port) (and with TLS on the next port) and answer commands until stdin ends."""
    from prfaas.transport.tcp_receiver import TcpReceiver
    from prfaas.transport.tickets import TicketVerifier
    from prfaas.transport.tls import server_context

    verifier = TicketVerifier({"k": bytes.fromhex(os.environ["PRFAAS_BENCH_KEY"])})
    receivers = {False: TcpReceiver(verifier, host, port, sock_buf_bytes=sock_buf_bytes)}
    certs = os.environ.get("PRFAAS_BENCH_TLS")
    if certs:
        tls = server_context(node_cert(certs, DECODE))
        receivers[True] = TcpReceiver(verifier, host, port + 1 if port else 0, sock_buf_bytes=sock_buf_bytes,
                                      ssl_context=tls)  # fmt: skip
    tls_port = receivers[True].address[1] if True in receivers else None
    reply({"ready": True, "port": receivers[False].address[1], "tls_port": tls_port})
    inbounds = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "expect":
            inbounds[cmd["job"]] = receivers[bool(cmd.get("tls"))].expect(cmd["job"], 1, cmd["timeout_s"])
            reply({"ok": True, "cpu_s": time.process_time()})
        elif cmd["op"] == "cpu":
            reply({"cpu_s": time.process_time()})
        elif cmd["op"] == "collect":
            inbound = inbounds.pop(cmd["job"])
            status = inbound.wait(cmd["timeout_s"])
            cpu = time.process_time()
            digest = ""
            if cmd.get("layers") and status.value == "completed":
                h = hasher()
                for i in range(cmd["layers"]):
                    k, v = inbound.layer(i, 1.0)
                    h.update(k)
                    h.update(v)
                digest = h.hexdigest()
            inbound.release()
            reply({"status": status.value, "cpu_s": cpu, "digest": digest})
    for rx in receivers.values():
        rx.close()
