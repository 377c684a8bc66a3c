"""The receiving process of the two transport benches (transport_loopback.py, transport_wan.py):
a `TcpReceiver` driven by JSON lines on stdin, one JSON reply per command on stdout.

    -> {"ready", "port"}
    {"op": "expect", "job", "timeout_s"}              -> {"ok", "cpu_s"}
    {"op": "cpu"}                                      -> {"cpu_s"}
    {"op": "collect", "job", "timeout_s", "layers"?}   -> {"status", "cpu_s", "digest"}

`cpu_s` is this process's CPU time when the reply's event happened (for collect: when the
shipment ended); `digest` is the xxh3-64 of the first `layers` layers' K and V, when
`layers` is given and the shipment completed, else "". The ticket key comes in
PRFAAS_BENCH_KEY (hex).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def reply(value: dict[str, Any]) -> None:
    print(json.dumps(value), flush=True)


def hasher() -> Any:
    import xxhash

    return xxhash.xxh3_64()


def serve_receiver(host: str, port: int, sock_buf_bytes: int | None = None) -> None:
    """Listen on (host, port) and answer commands until stdin ends."""
    from prfaas.transport.tcp_receiver import TcpReceiver
    from prfaas.transport.tickets import TicketVerifier

    verifier = TicketVerifier({"k": bytes.fromhex(os.environ["PRFAAS_BENCH_KEY"])})
    rx = TcpReceiver(verifier, host, port, sock_buf_bytes=sock_buf_bytes)
    reply({"ready": True, "port": rx.address[1]})
    inbounds = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "expect":
            inbounds[cmd["job"]] = rx.expect(cmd["job"], 1, cmd["timeout_s"])
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
    rx.close()
