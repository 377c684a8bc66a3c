"""KV transport on plain loopback: prfaas beside Mooncake's transfer engine (TCP) and NIXL (UCX/TCP).

    python bench/transport_loopback.py --size-mb 256 --rounds 3 --json out.json
    python bench/transport_loopback.py --systems prfaas --tls both --json out.json   # the cost of TLS

One run, interleaved rounds (each round moves one payload with every system, in an order
rotated per round), best and median per system. Every system runs as two processes
(sender, receiver) on 127.0.0.1 and every transfer is checked byte for byte (xxh3-64):

    prfaas-N         TcpChannel -> TcpReceiver, raw codec, N fixed streams (--streams)
    prfaas-adaptive  the same with the channel's own stream count (warmed --adaptive-warmup-s)
    prfaas-*-tls     the same over mutual TLS 1.3 (--tls on|both; both: plaintext and TLS
                     interleaved in every round, rows carry "tls": true/false)
    mooncake         TransferEngine, P2PHANDSHAKE, "tcp" protocol, transfer_sync_write
    nixl             nixl_agent, UCX backend with UCX_TLS=tcp, one WRITE + notification

The peers run under .venv-peers (bash bench/peers/setup.sh); without it only prfaas runs.
Peer pairs are started afresh every round (an idle NIXL agent's progress thread burns
~0.65 core per process, which would tax whatever runs beside it on 2 cores); each pair's
handshake and a warm-up transfer come before the timed one and are reported as setup.
The payload is the SmolLM2 KV of bench/transport_wan.py when it exists, else random bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from prfaas.bench.piped import Piped

KEY = os.urandom(32)
HERE = Path(__file__).resolve().parent
KV_PATH = Path(os.environ.get("PRFAAS_HOME", Path.home() / ".cache" / "prfaas")) / "bench" / "smollm2-kv-2048.npz"
SYNTH_SHAPE = (3, 2048, 64)  # SmolLM2-135M's per-layer K (or V) shape, bf16
SYNTH_LAYERS = 30


# ------------------------------------------------------------------ prfaas processes


def role_receiver() -> None:
    from prfaas.bench.transport_roles import serve_receiver

    serve_receiver("127.0.0.1", 0)


def load_parts(kv_path: Path | None) -> tuple[list[tuple[bytes, bytes]], tuple[int, ...]]:
    import numpy as np

    if kv_path is not None and kv_path.exists():
        arrays = np.load(kv_path)
        num_layers = sum(1 for name in arrays.files if name.endswith("_0"))  # besides them: query_energy
        parts = [(arrays[f"{i}_0"].tobytes(), arrays[f"{i}_1"].tobytes()) for i in range(num_layers)]
        return parts, tuple(int(d) for d in arrays["0_0"].shape)
    rng = np.random.default_rng(1)
    n = int(np.prod(SYNTH_SHAPE)) * 2
    return [(rng.bytes(n), rng.bytes(n)) for _ in range(SYNTH_LAYERS)], SYNTH_SHAPE


def role_sender(port: int, tls_port: int | None, kv: str) -> None:
    from prfaas.bench.transport_roles import client_tls, hasher, reply
    from prfaas.transport.api import Shipment, ShipmentSpec
    from prfaas.transport.tcp_sender import TcpChannel

    parts, shape = load_parts(Path(kv) if kv else None)
    channels: dict[str, TcpChannel] = {}
    reply({"ready": True, "layer_bytes": 2 * len(parts[0][0])})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "channel":
            t0 = time.perf_counter()
            tls = client_tls(os.environ["PRFAAS_BENCH_TLS"]) if cmd["tls"] else {}
            address = ("127.0.0.1", tls_port if cmd["tls"] and tls_port else port)
            channels[cmd["label"]] = TcpChannel(address, num_streams=cmd["streams"], **tls)
            reply({"ok": True, "setup_s": time.perf_counter() - t0})
        elif cmd["op"] == "digest":
            h = hasher()
            for i in range(cmd["layers"]):
                h.update(parts[i % len(parts)][0])
                h.update(parts[i % len(parts)][1])
            reply({"digest": h.hexdigest()})
        elif cmd["op"] == "ship":
            channel = channels[cmd["label"]]
            spec = ShipmentSpec(cmd["job"], 1, cmd["ticket"], "bfloat16", (shape,) * cmd["layers"], "raw",
                                cmd["timeout_s"])  # fmt: skip
            cpu0 = time.process_time()
            shipment = Shipment(spec)
            transfer = channel.submit(shipment)
            for i in range(cmd["layers"]):
                shipment.add_layer(i, *parts[i % len(parts)])
            status = transfer.wait(cmd["timeout_s"] + 1)
            elapsed = (transfer.stats.finished_s or time.monotonic()) - transfer.stats.started_s
            reply({"status": status.value, "seconds": elapsed, "raw_bytes": transfer.stats.raw_bytes,
                    "cpu_s": time.process_time() - cpu0, "streams": channel.num_streams})  # fmt: skip
    for channel in channels.values():
        channel.close()


class Prfaas:
    """The prfaas sender and receiver processes; with `certs` (bench_certs) the receiver also
    listens with TLS, and channels opened with `tls` use it."""

    def __init__(self, kv_path: Path | None, run_timeout_s: float, certs: Path | None = None) -> None:
        from prfaas.transport.tickets import TicketSigner

        self.signer = TicketSigner({"k": KEY}, "k")
        self.timeout_s = run_timeout_s
        env = {**os.environ, "PRFAAS_BENCH_KEY": KEY.hex(), "PRFAAS_BENCH_TLS": str(certs or "")}
        me = [sys.executable, str(Path(__file__).resolve())]
        self.rx = Piped([*me, "--_role", "receiver"], env)
        ready = self.rx.read()
        ports = ["--_port", str(ready["port"]), "--_tls-port", str(ready["tls_port"] or 0)]
        self.tx = Piped([*me, "--_role", "sender", *ports, "--_kv", str(kv_path or "")], env)
        self.layer_bytes: int = self.tx.read()["layer_bytes"]
        self.setup: dict[str, float] = {}
        self.tls: dict[str, bool] = {}
        self.digests: dict[int, str] = {}

    def channel(self, label: str, streams: int | None, tls: bool = False) -> None:
        self.tls[label] = tls
        self.setup[label] = self.tx.ask(op="channel", label=label, streams=streams, tls=tls)["setup_s"]

    def ship(self, label: str, layers: int, verify: bool = True) -> dict[str, Any]:
        job = str(uuid.uuid4())
        wait = self.timeout_s + 10
        expected = self.rx.ask(wait, op="expect", job=job, timeout_s=self.timeout_s + 5, tls=self.tls[label])
        ticket = self.signer.issue(job, 1, "bench", 1 << 40, ttl_s=600)
        r = self.tx.ask(wait, op="ship", label=label, job=job, ticket=ticket, layers=layers, timeout_s=self.timeout_s)
        got = self.rx.ask(wait, op="collect", job=job, timeout_s=5, layers=layers if verify else 0)
        r["cpu_s_recv"] = got["cpu_s"] - expected["cpu_s"]  # the receiver process, expect to the shipment's end
        if verify:
            if layers not in self.digests:
                self.digests[layers] = self.tx.ask(op="digest", layers=layers)["digest"]
            r["verified"] = got["digest"] == self.digests[layers]
        return r

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


# ------------------------------------------------------------------ orchestration


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import tempfile

    from prfaas.bench.peers.driver import PeerError, PeerPair, peers_python
    from prfaas.bench.transport_roles import bench_certs

    kv_path = args.kv if args.kv and args.kv.exists() else None
    print(f"# payload: {kv_path or 'random bytes (no SmolLM2 KV at ' + str(args.kv) + ')'}", flush=True)
    peers = [s for s in ("mooncake", "nixl") if s in args.systems]
    py = peers_python()
    if peers and py is None:
        print("# .venv-peers is missing (bash bench/peers/setup.sh): running prfaas only", flush=True)
        peers = []
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.tls]
    certs = bench_certs(Path(tempfile.mkdtemp(prefix="prfaas-bench-certs-")), ["127.0.0.1"]) if any(modes) else None
    pr = Prfaas(kv_path, args.run_timeout_s, certs)
    layers = max(1, int(args.size_mb * 2**20 / pr.layer_bytes))
    size = layers * pr.layer_bytes  # the peers move exactly as many bytes as prfaas
    labels: list[tuple[str, int | None, bool]] = []
    if "prfaas" in args.systems:
        configs = [(f"prfaas-{n}", n) for n in args.streams] + [("prfaas-adaptive", None)]
        labels = [(label + ("-tls" if tls else ""), streams, tls) for label, streams in configs for tls in modes]
    for label, streams, tls in labels:
        pr.channel(label, streams, tls)
        pr.ship(label, max(1, layers // 8), verify=False)  # connections open, windows grown
        warm_until = time.monotonic() + (args.adaptive_warmup_s if streams is None else 0)
        while time.monotonic() < warm_until:
            pr.ship(label, max(1, layers // 2), verify=False)
    print(f"# {size / 2**20:.0f} MiB per transfer, {args.rounds} rounds, host loadavg "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)  # fmt: skip
    systems = [label for label, _, _ in labels] + peers
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
        for name in order:
            row: dict[str, Any] = {"system": name.split("-")[0], "label": name, "size_bytes": size, "round": rnd}
            if name.startswith("prfaas"):
                r = pr.ship(name, layers)
                ok = r["status"] == "completed" and r["verified"]
                row.update(streams=r["streams"], adaptive="adaptive" in name, tls=pr.tls[name], seconds=r["seconds"],
                           ok=ok, cpu_s_send=r["cpu_s"], cpu_s_recv=r["cpu_s_recv"], setup_s=pr.setup[name],
                           error="" if ok else f"status {r['status']}, verified {r['verified']}")  # fmt: skip
            else:
                assert py is not None
                try:
                    with PeerPair(name, size, python=py, data=kv_path, timeout_s=60) as pair:
                        pair.transfer(max(4096, size // 8), timeout_s=args.run_timeout_s)  # warm-up
                        p = pair.transfer(size, timeout_s=args.run_timeout_s)
                        setup_s = pair.setup["total_wall_s"]
                except PeerError as exc:
                    p, setup_s = {"ok": False, "error": str(exc)[:400], "seconds": 0.0, "tcp_conns": 0}, 0.0
                row.update(streams=p["tcp_conns"], adaptive=False, tls=False, seconds=p["seconds"], ok=p["ok"],
                           cpu_s_send=p.get("cpu_s_send"), cpu_s_recv=p.get("cpu_s_recv"), setup_s=setup_s,
                           error=p["error"])  # fmt: skip
            row["gb_per_s"] = size / row["seconds"] / 1e9 if row["ok"] and row["seconds"] > 0 else 0.0
            rows.append(row)
            print(f"  round {rnd}  {name:18} {row['gb_per_s']:6.2f} GB/s  streams {row['streams']:>3}  "
                  f"{'ok' if row['ok'] else 'FAILED ' + row['error'][:200]}", flush=True)  # fmt: skip
    pr.close()
    print("# host loadavg at end " + " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    return rows


def cpu_per_gb(rows: list[dict[str, Any]], side: str) -> str:
    """Median CPU seconds per GB moved of one end (`send`, `recv`), or "-" if not measured."""
    values = [r[f"cpu_s_{side}"] / (r["size_bytes"] / 1e9) for r in rows if r["ok"] and r.get(f"cpu_s_{side}")]
    return f"{statistics.median(values):.2f}" if values else "-"


def table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'system':18} {'streams':>7} {'best GB/s':>9} {'median':>7} {'ok/runs':>7} {'setup s':>7} "
          f"{'CPU s/GB send':>13} {'recv':>5}")  # fmt: skip
    labels = list(dict.fromkeys(r["label"] for r in rows))
    best_peer = max((r["gb_per_s"] for r in rows if r["system"] != "prfaas"), default=0.0)
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        rates = [r["gb_per_s"] for r in mine if r["ok"]]
        streams = "/".join(str(s) for s in sorted({r["streams"] for r in mine}))
        best, med = (max(rates), statistics.median(rates)) if rates else (0.0, 0.0)
        vs = f"  {best / best_peer:4.2f}x best peer" if label.startswith("prfaas") and best_peer else ""
        print(f"{label:18} {streams:>7} {best:9.2f} {med:7.2f} {len(rates):>3}/{len(mine):<3} "
              f"{statistics.median(r['setup_s'] for r in mine):7.2f} {cpu_per_gb(mine, 'send'):>13} "
              f"{cpu_per_gb(mine, 'recv'):>5}{vs}")  # fmt: skip
    for label in labels:  # the cost of TLS: each configuration's median over its plaintext twin's
        plain = [r["gb_per_s"] for r in rows if r["label"] == label.removesuffix("-tls") and r["ok"]]
        tls = [r["gb_per_s"] for r in rows if r["label"] == label and r["ok"]]
        if label.endswith("-tls") and plain and tls:
            print(f"{label:18} TLS/plaintext median {statistics.median(tls) / statistics.median(plain):.2f}x "
                  f"(best {max(tls) / max(plain):.2f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=256.0, help="payload per transfer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8], help="prfaas fixed stream counts")
    parser.add_argument("--systems", nargs="+", default=["prfaas", "mooncake", "nixl"],
                        choices=["prfaas", "mooncake", "nixl"])  # fmt: skip
    parser.add_argument("--adaptive-warmup-s", type=float, default=3.0)
    parser.add_argument("--tls", choices=["off", "on", "both"], default="off",
                        help="prfaas over mutual TLS: on, or both (plaintext and TLS interleaved)")  # fmt: skip
    parser.add_argument("--run-timeout-s", type=float, default=60.0, help="deadline of one transfer")
    parser.add_argument("--kv", type=Path, default=KV_PATH, help="SmolLM2 KV .npz (default: transport_wan's)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--_role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    parser.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_tls-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_kv", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._role == "receiver":
        return role_receiver()
    if args._role == "sender":
        return role_sender(args._port, args._tls_port or None, args._kv)
    rows = run(args)
    table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
