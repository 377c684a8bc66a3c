"""Every KV transport side by side: MB/s, CPU seconds per GB, and what a 2,048-token SmolLM2
shipment adds to TTFT, on loopback and over an emulated WAN link.

    sudo .venv/bin/python bench/transport_matrix.py --rounds 3 --json out.json
    sudo .venv/bin/python bench/transport_matrix.py --wan continental --rounds 1

Payload: SmolLM2-135M's KV of 2,048 tokens (30 layers x K and V of [3, 2048, 64] bf16,
47.2 MB), raw codec, deterministic bytes; every shipment is checked byte for byte (xxh3-64)
at the receiver, after the timed part (that hashing is not in the CPU figures). Sender and
receiver are two processes (`--role`), the driver only relays commands and WebRTC offers;
on loopback both run in a network namespace of this run whose lo also has 127.0.0.2
(aiortc gathers no 127.0.0.1 candidate), on the WAN in the two namespaces of
devstack/wanlink.py. Rounds are interleaved (each system once per round, in
an order rotated per round); figures are medians.

    inproc     the same protocol by function call, sender and receiver in one process
    shm        ShmChannel -> ShmReceiver (same host only; not on the WAN)
    tcp        TcpChannel (adaptive streams, the default) -> TcpReceiver; tcp-N: N fixed streams
    webrtc-N   WebRtcChannel with N data channels (peer connections) -> WebRtcReceiver

Columns: MB/s over `--shipments` back-to-back whole shipments; CPU s/GB, both processes'
user + system time per GB moved; `whole ms`, one shipment handed over at once (what TTFT
grows by when the cache ships after the forward); `tail ms`, time from the last layer's
hand-over to DONE when layers arrive every `--layer-interval-ms` (layer-wise shipment: what
TTFT grows by when shipping overlaps the forward).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from prfaas.bench.piped import Piped as Peer  # a role process: JSON lines over its pipes, bounded reads

HERE = Path(__file__).resolve().parent
NUM_LAYERS, SHAPE = 30, (3, 2048, 64)  # SmolLM2-135M, 2,048 tokens, bf16
KEY_ENV = "PRFAAS_BENCH_KEY"
ONE_HOST = ("inproc", "shm")  # never on the WAN: sender and receiver share a process / the host's memory
REPLY_WAIT_S = 600.0  # the longest a role may take to answer (a shipment's own deadline is 600 s)


def _layers(seed: int = 1) -> list[tuple[bytes, bytes]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    size = SHAPE[0] * SHAPE[1] * SHAPE[2] * 2
    return [(rng.bytes(size), rng.bytes(size)) for _ in range(NUM_LAYERS)]


def _digest(layers: list[tuple[Any, Any]]) -> int:
    import xxhash

    h = xxhash.xxh3_64()
    for k, v in layers:
        h.update(k)
        h.update(v)
    return h.intdigest()


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _say(value: dict[str, Any]) -> None:
    print(json.dumps(value), flush=True)


# ---------------------------------------------------------------- receiver process


def role_receiver(system: str) -> None:
    from prfaas.transport.tickets import TicketVerifier

    verifier = TicketVerifier({"k": bytes.fromhex(os.environ[KEY_ENV])})
    expected = _digest(_layers())
    counts = {"verified": 0, "failed": 0}
    rx: Any
    if system.startswith("tcp"):
        from prfaas.transport.tcp_receiver import TcpReceiver

        rx = TcpReceiver(verifier, os.environ.get("PRFAAS_BENCH_HOST", "127.0.0.1"), 0)
        _say({"port": rx.address[1]})
    elif system == "shm":
        from prfaas.transport.shm_receiver import ShmReceiver

        rx = ShmReceiver(verifier, arena_bytes=512 << 20)
        _say({"path": rx.path})
    else:
        from prfaas.transport.webrtc_receiver import WebRtcReceiver

        rx = WebRtcReceiver(verifier)
        _say({"ready": True})

    inbounds: list[Any] = []
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "expect":
            inbounds += [rx.expect(job, 1, 600) for job in cmd["jobs"]]
            _say({"ok": True})
        elif cmd["cmd"] == "offer":
            _say({"answer": rx.answer(cmd["offer"], 20)})
        elif cmd["cmd"] == "cpu":
            _say({"cpu_s": _cpu_s()})
        elif cmd["cmd"] == "verify":  # after the timed shipments: the hashing is not measured
            cpu = _cpu_s()
            for inbound in inbounds:
                ok = inbound.wait(600).value == "completed"
                ok = ok and _digest([inbound.layer(i, 1) for i in range(NUM_LAYERS)]) == expected
                inbound.release()
                counts["verified" if ok else "failed"] += 1
            inbounds = []
            _say(counts | {"cpu_s": cpu})


# ---------------------------------------------------------------- sender process


def role_sender(system: str, target: dict[str, Any]) -> None:
    from prfaas.transport.api import Shipment, ShipmentSpec
    from prfaas.transport.tickets import TicketSigner

    signer = TicketSigner({"k": bytes.fromhex(os.environ[KEY_ENV])}, "k")
    layers = _layers()
    answers: queue.Queue[dict[str, str]] = queue.Queue()
    commands: queue.Queue[dict[str, Any]] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            msg = json.loads(line)
            (answers if "answer" in msg else commands).put(msg.get("answer", msg))
        commands.put({"cmd": "quit"})

    threading.Thread(target=read_stdin, daemon=True).start()
    say_lock = threading.Lock()

    def signal(offer: dict[str, str], timeout_s: float) -> dict[str, str]:
        with say_lock:
            _say({"offer": offer})
            return answers.get(timeout=timeout_s)

    channel: Any
    inproc_rx: Any = None
    if system == "inproc":
        from prfaas.transport.inproc import InProcessChannel, InProcessReceiver
        from prfaas.transport.tickets import TicketVerifier

        inproc_rx = InProcessReceiver(TicketVerifier({"k": bytes.fromhex(os.environ[KEY_ENV])}))
        channel = InProcessChannel(inproc_rx)
    elif system.startswith("tcp"):
        from prfaas.transport.tcp_sender import TcpChannel

        streams = int(system.split("-")[1]) if "-" in system else None  # None: adaptive
        channel = TcpChannel((target["host"], target["port"]), num_streams=streams)
    elif system == "shm":
        from prfaas.transport.shm_sender import ShmChannel

        channel = ShmChannel(target["path"])
    else:
        from prfaas.transport.webrtc_sender import WebRtcChannel

        channel = WebRtcChannel(signal, num_streams=int(system.split("-")[1]))
    with say_lock:
        _say({"ready": True})

    def ship(job: str, interval_s: float) -> tuple[float, float]:
        shapes = (SHAPE,) * NUM_LAYERS
        ticket = signer.issue(job, 1, "bench", 2 * NUM_LAYERS * SHAPE[0] * SHAPE[1] * SHAPE[2] * 2, ttl_s=900)
        spec = ShipmentSpec(job, 1, ticket, "bfloat16", shapes, codec="raw", timeout_s=600)
        inbound = inproc_rx.expect(job, 1, 600) if inproc_rx is not None else None
        shipment = Shipment(spec)
        start = time.perf_counter()
        transfer = channel.submit(shipment)
        for index, (k, v) in enumerate(layers):
            if interval_s and index:
                time.sleep(interval_s)
            shipment.add_layer(index, k, v)
        last = time.perf_counter()
        status = transfer.wait(600)
        end = time.perf_counter()
        if status.value != "completed":
            raise SystemExit(f"{system}: shipment {status.value}: {transfer.error}")
        if inbound is not None:
            received.append(inbound)
        return end - start, end - last

    expected = _digest(layers)
    received: list[Any] = []  # in-process: checked after the timed part, like the receiver process does
    while (cmd := commands.get()).get("cmd") != "quit":
        cpu = _cpu_s()
        times = [ship(job, cmd.get("interval_s", 0.0)) for job in cmd["jobs"]]
        reply = {"seconds": [t for t, _ in times], "tails": [t for _, t in times], "cpu_s": _cpu_s() - cpu}
        for inbound in received:
            if _digest([inbound.layer(i, 1) for i in range(NUM_LAYERS)]) != expected:
                raise SystemExit("inproc: a shipment arrived corrupted")
            inbound.release()
        received.clear()
        with say_lock:
            _say(reply)
    channel.close()


# ---------------------------------------------------------------- driver


class Pair:
    """A receiver and a sender process for one system, started in the given namespaces."""

    def __init__(self, system: str, ns_rx: str, ns_tx: str, host: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PRFAAS_BENCH_HOST=host)
        me = [sys.executable, str(Path(__file__).resolve())]
        self.system = system
        self.rx: Peer | None = None
        target: dict[str, Any] = {"host": host}
        if system != "inproc":
            self.rx = Peer(["ip", "netns", "exec", ns_rx, *me, "--role", "receiver", "--system", system], env)
            target |= self.rx.read(60)
        argv = [*me, "--role", "sender", "--system", system, "--target", json.dumps(target)]
        self.tx = Peer(["ip", "netns", "exec", ns_tx, *argv], env)
        self._relay()

    def _relay(self) -> dict[str, Any]:
        """The sender's next reply, relaying WebRTC offers to the receiver meanwhile."""
        while "offer" in (msg := self.tx.read(REPLY_WAIT_S)):
            assert self.rx is not None
            self.rx.send({"cmd": "offer", "offer": msg["offer"]})
            self.tx.send({"answer": self.rx.read(60)["answer"]})
        return msg

    def ship(self, count: int, interval_s: float = 0.0) -> dict[str, Any]:
        jobs = [str(uuid.uuid4()) for _ in range(count)]
        rx_cpu = 0.0
        if self.rx is not None:
            self.rx.send({"cmd": "cpu"})
            rx_cpu = self.rx.read(REPLY_WAIT_S)["cpu_s"]
            self.rx.send({"cmd": "expect", "jobs": jobs})
            self.rx.read(REPLY_WAIT_S)
        self.tx.send({"jobs": jobs, "interval_s": interval_s})
        reply = self._relay()
        if self.rx is not None:
            self.rx.send({"cmd": "verify"})
            stats = self.rx.read(REPLY_WAIT_S)
            if stats["failed"] or stats["verified"] != self.total:
                raise SystemExit(f"{self.system}: {stats} after {self.total} shipments")
            reply["rx_cpu_s"] = stats["cpu_s"] - rx_cpu
        return reply

    total = 0

    def run(self, shipments: int, interval_s: float) -> dict[str, Any]:
        self.total += 1
        self.ship(1)  # warm-up: connections, pools, arena pages
        self.total += shipments
        bulk = self.ship(shipments)
        self.total += 1
        layerwise = self.ship(1, interval_s)
        size = 2 * NUM_LAYERS * SHAPE[0] * SHAPE[1] * SHAPE[2] * 2
        seconds = sum(bulk["seconds"])
        cpu = bulk["cpu_s"] + bulk.get("rx_cpu_s", 0.0)
        return {
            "system": self.system, "mb_s": shipments * size / seconds / 1e6,
            "cpu_s_per_gb": cpu / (shipments * size / 1e9), "whole_ms": 1e3 * statistics.median(bulk["seconds"]),
            "tail_ms": 1e3 * layerwise["tails"][0],
        }  # fmt: skip

    def close(self) -> None:
        self.tx.kill()
        if self.rx is not None:
            self.rx.kill()


@contextlib.contextmanager
def loopback_ns() -> Any:
    name = f"prfaas-matrix-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", name, "addr", "add", "127.0.0.2/8", "dev", "lo"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["receiver", "sender"])
    ap.add_argument("--system")
    ap.add_argument("--target", default="{}")
    ap.add_argument("--systems", nargs="+", default=["inproc", "shm", "tcp", "webrtc-1", "webrtc-4"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shipments", type=int, default=4, help="whole shipments per measurement (webrtc: 1)")
    ap.add_argument("--layer-interval-ms", type=float, default=10.0)
    ap.add_argument("--wan", choices=["continental", "intercontinental"], help="over devstack/wanlink.py instead")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.role == "receiver":
        return role_receiver(args.system)
    if args.role == "sender":
        return role_sender(args.system, json.loads(args.target))
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    if args.shipments < 1:
        ap.error(f"--shipments {args.shipments}: at least 1")
    if args.wan and not [s for s in args.systems if s not in ONE_HOST]:
        ap.error(f"--wan: {', '.join(ONE_HOST)} run on one host only; name a system that crosses the link "
                 "(tcp, tcp-N, webrtc-N)")  # fmt: skip
    os.environ[KEY_ENV] = os.urandom(32).hex()
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    with contextlib.ExitStack() as stack:
        if args.wan:
            from prfaas.devstack.wanlink import PROFILES, wan_link

            link = stack.enter_context(wan_link(*PROFILES[args.wan]))
            ns_rx, ns_tx, host = link.ns_b, link.ns_a, link.addr_b
            systems = [s for s in args.systems if s not in ONE_HOST]
        else:
            ns_rx = ns_tx = stack.enter_context(loopback_ns())
            host, systems = "127.0.0.1", list(args.systems)
        for round_no in range(args.rounds):
            order = systems[round_no % len(systems) :] + systems[: round_no % len(systems)]
            for system in order:
                pair = Pair(system, ns_rx, ns_tx, host)
                try:
                    shipments = 1 if system.startswith("webrtc") else args.shipments
                    row = pair.run(shipments, args.layer_interval_ms / 1e3)
                finally:
                    pair.close()
                rows[system].append(row)
                print(f"round {round_no + 1} {system:9s} {row['mb_s']:9.1f} MB/s {row['cpu_s_per_gb']:6.2f} CPU s/GB"
                      f" whole {row['whole_ms']:8.1f} ms tail {row['tail_ms']:7.1f} ms", file=sys.stderr)  # fmt: skip
    tcp = statistics.median(r["mb_s"] for r in rows.get("tcp", [])) if rows.get("tcp") else None
    print(f"\n{'system':10s} {'MB/s':>9s} {'x tcp':>6s} {'CPU s/GB':>9s} {'whole ms':>9s} {'tail ms':>8s}")
    summary = []
    for system in systems:
        med = {
            k: statistics.median(r[k] for r in rows[system]) for k in ("mb_s", "cpu_s_per_gb", "whole_ms", "tail_ms")
        }
        ratio = med["mb_s"] / tcp if tcp else None  # None (JSON null): no tcp run to compare with
        summary.append({"system": system, **med, "x_tcp": ratio, "rounds": rows[system]})
        x_tcp = f"{ratio:6.2f}" if ratio is not None else f"{'-':>6s}"
        print(f"{system:10s} {med['mb_s']:9.1f} {x_tcp} {med['cpu_s_per_gb']:9.2f} {med['whole_ms']:9.1f}"
              f" {med['tail_ms']:8.1f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"wan": args.wan, "args": vars(args) | {"json": str(args.json)},
                                         "load_avg": os.getloadavg(), "rows": summary}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
