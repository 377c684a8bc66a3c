"""KV transport over an emulated WAN: goodput vs link rate for stream counts x codecs.

    python bench/transport_wan.py --profile continental --profile intercontinental --json out.json
    python bench/transport_wan.py --profile continental --tls both --cc cubic --streams --codec raw --rounds 4

Two network namespaces joined by the userspace link emulator (devstack/wanlink.py); a
receiver process (TcpReceiver) in one, a sender process (TcpChannel) in the other, both
driven by this process over pipes. The payload is real SmolLM2-135M KV (bf16, 2048
tokens), repeated to --size-mb. For each congestion control, each fixed stream count and
the adaptive default, and each codec, it prints and records:

    wire_ratio       wire bytes/s / link rate  (how full the link is)
    effective_ratio  raw KV bytes/s / link rate (what compression adds)
    cpu_s_per_gb     sender + receiver CPU seconds per GB of raw KV
    raw_mb           raw KV of the shipment, MiB (2**20 bytes, as --size-mb; the result files
                     in docs/results/ from before this unit was fixed hold 10**6-byte MB)

`--tls both` runs every configuration over plaintext and over mutual TLS 1.3 side by side
(both channels warmed, the measured shipments interleaved, the order alternating per round);
every row carries `tls` (true/false) and `round`. Needs root (namespaces, TUN). Every run is
bounded by --run-timeout-s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from prfaas.bench.piped import Piped

KEY = os.urandom(32)
PROFILES = {"continental": (40.0, 300.0, 0.01), "intercontinental": (80.0, 300.0, 0.1)}
BIG_BUF = 64 << 20


def kv_file() -> Path:
    """The KV file `real_kv` writes (under $PRFAAS_HOME/bench), written first when it is missing or older
    than kvw6 and kvw4 (without the query energy)."""
    import numpy as np

    path = Path(os.environ.get("PRFAAS_HOME", Path.home() / ".cache" / "prfaas")) / "bench" / "smollm2-kv-2048.npz"
    if not path.exists() or "query_energy" not in np.load(path).files:
        path.parent.mkdir(parents=True, exist_ok=True)
        real_kv(path)
    return path


def real_kv(path: Path) -> None:
    """Write SmolLM2 bf16 KV of 2048 real tokens: one .npy per layer part, and the model's query energy
    (what a calibrated prefill region ships keys with: kvw6 and kvw4 shape key steps by it)."""
    import argparse as text_source
    import inspect

    import numpy as np
    import torch

    from prfaas.engine.hf import HFEngine
    from prfaas.engine.sampling import SamplingParams

    engine = HFEngine("smollm2-135m", dtype="bfloat16")
    kv = engine.prefill(engine.encode(inspect.getsource(text_source))[:2048], SamplingParams(max_new_tokens=1)).kv
    arrays = {f"{i}_{p}": t.contiguous().view(torch.int16).numpy() for i, layer in enumerate(kv.layers)
              for p, t in enumerate((layer.k, layer.v))}  # fmt: skip
    if engine.query_energy is None:
        raise SystemExit("smollm2-135m is not calibrated: run `prfaas model calibrate smollm2-135m` (make models)")
    arrays["query_energy"] = engine.query_energy
    np.savez(path, **arrays)  # type: ignore[arg-type]


# ------------------------------------------------------------------ processes in the namespaces


def role_receiver(host: str, buf: int) -> None:  # plaintext on 7400; with certificates, TLS on 7401
    from prfaas.bench.transport_roles import serve_receiver

    serve_receiver(host, 7400, sock_buf_bytes=buf or None)


def role_sender(host: str, kv_path: str) -> None:
    import numpy as np

    from prfaas.bench.transport_roles import client_tls, reply
    from prfaas.transport.api import Shipment, ShipmentSpec
    from prfaas.transport.tcp_sender import TcpChannel

    arrays = np.load(kv_path)
    num_real = sum(1 for name in arrays.files if name.endswith("_0"))
    energy = arrays["query_energy"]
    parts = [(arrays[f"{i}_0"].tobytes(), arrays[f"{i}_1"].tobytes()) for i in range(num_real)]
    shape = tuple(int(d) for d in arrays["0_0"].shape)
    channels: dict[bool, TcpChannel] = {}  # by tls
    reply({"ready": True, "layer_bytes": 2 * len(parts[0][0])})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "channel":
            for old in channels.values():
                old.close()
            channels = {}
            for tls in cmd["tls"]:
                options = client_tls(os.environ["PRFAAS_BENCH_TLS"]) if tls else {}
                channels[tls] = TcpChannel((host, 7401 if tls else 7400), num_streams=cmd["streams"],
                                           congestion_control=cmd["cc"], sock_buf_bytes=cmd["buf"] or None,
                                           **options)  # fmt: skip
            reply({"ok": True})
        elif cmd["op"] == "ship":
            channel = channels[bool(cmd.get("tls"))]
            weights = [energy[i % num_real] for i in range(cmd["layers"])]
            spec = ShipmentSpec(cmd["job"], 1, cmd["ticket"], "bfloat16", (shape,) * cmd["layers"], cmd["codec"],
                                cmd["timeout_s"], key_weights=weights)  # fmt: skip
            cpu0, start = time.process_time(), time.perf_counter()
            shipment = Shipment(spec)
            transfer = channel.submit(shipment)
            for i in range(cmd["layers"]):
                shipment.add_layer(i, *parts[i % num_real])
            status = transfer.wait(cmd["timeout_s"] + 1)
            elapsed = (transfer.stats.finished_s or time.monotonic()) - transfer.stats.started_s
            reply({"status": status.value, "seconds": elapsed, "wall_s": time.perf_counter() - start,
                    "raw_bytes": transfer.stats.raw_bytes, "wire_bytes": transfer.stats.wire_bytes,
                    "cpu_s": time.process_time() - cpu0, "streams": channel.num_streams,
                    "resent": transfer.stats.resent_chunks,
                    "history": list(channel.controller.history)[-40:] if channel.controller else None})  # fmt: skip
    for channel in channels.values():
        channel.close()


# ------------------------------------------------------------------ orchestration


def run_profile(name: str, args: argparse.Namespace, kv_path: Path, rows: list[dict[str, Any]]) -> None:
    import tempfile

    from prfaas.bench.transport_roles import bench_certs
    from prfaas.devstack.wanlink import wan_link
    from prfaas.transport.tickets import TicketSigner

    rtt_ms, rate_mbit, loss_pct = PROFILES[name]
    signer = TicketSigner({"k": KEY}, "k")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.tls]
    env = {**os.environ, "PRFAAS_BENCH_KEY": KEY.hex(), "PRFAAS_BENCH_TLS": ""}
    me = [sys.executable, str(Path(__file__).resolve())]
    buf = 0  # sockets keep kernel autotuning; --big-buffers raises its ceiling instead
    with wan_link(rtt_ms=rtt_ms, rate_mbit=rate_mbit, loss_pct=loss_pct) as link:
        if not args.slow_start_after_idle:
            # A pooled transport wants its connections' windows kept between jobs: the
            # recommended operator setting (docs/operations), applied in both namespaces.
            link.sysctl("net.ipv4.tcp_slow_start_after_idle", "0")
        if args.big_buffers:
            link.sysctl("net.ipv4.tcp_rmem", f"4096 131072 {BIG_BUF}")
            link.sysctl("net.ipv4.tcp_wmem", f"4096 16384 {BIG_BUF}")
        if any(modes):
            certs = bench_certs(Path(tempfile.mkdtemp(prefix="prfaas-bench-certs-")), [link.addr_b])
            env["PRFAAS_BENCH_TLS"] = str(certs)
        rx = Piped([*me, "--_role", "receiver", "--_host", link.addr_b, "--_buf", str(buf)], env,
                   functools.partial(link.run_in, "b"))  # fmt: skip
        rx.read()
        tx = Piped([*me, "--_role", "sender", "--_host", link.addr_b, "--_kv", str(kv_path)], env,
                   functools.partial(link.run_in, "a"))  # fmt: skip
        layer_bytes = tx.read()["layer_bytes"]
        layers = max(1, int(args.size_mb * 2**20 / layer_bytes))
        link_bps = rate_mbit * 1e6 / 8
        wait_s = args.run_timeout_s + 30  # a shipment's own deadline, then the reply's way back

        def ship(codec: str, layers: int, tls: bool) -> dict[str, Any]:
            job = str(uuid.uuid4())
            rx.ask(op="expect", job=job, timeout_s=args.run_timeout_s + 5, tls=tls)
            ticket = signer.issue(job, 1, "bench", 1 << 40, ttl_s=600)
            result = tx.ask(wait_s, op="ship", job=job, ticket=ticket, codec=codec, layers=layers,
                            timeout_s=args.run_timeout_s, tls=tls)  # fmt: skip
            result["rx_cpu_s"] = rx.ask(wait_s, op="collect", job=job, timeout_s=5)["cpu_s"]
            return result

        for cc in args.cc:
            for streams in [*args.streams, None]:
                tx.ask(op="channel", streams=streams, cc=cc, buf=buf, tls=modes)
                # warm each pool (connections open, windows grown; the adaptive count settles)
                for tls in modes:
                    warm_until = time.monotonic() + (args.adaptive_warmup_s if streams is None else args.fixed_warmup_s)
                    ship("raw", max(1, layers // 8), tls)
                    while time.monotonic() < warm_until:
                        ship("raw", max(1, layers // 2), tls)  # --size-mb under two layers: one
                runs = [(codec, rnd, tls) for codec in args.codec for rnd in range(args.rounds)
                        for tls in (modes if rnd % 2 == 0 else modes[::-1])]  # fmt: skip
                for codec, rnd, tls in runs:
                    rx_cpu0 = rx.ask(op="cpu")["cpu_s"]
                    r = ship(codec, layers, tls)
                    seconds = max(r["seconds"], 1e-9)
                    row = {
                        "profile": name, "rtt_ms": rtt_ms, "rate_mbit": rate_mbit, "loss_pct": loss_pct, "cc": cc,
                        "streams": r["streams"] if streams is None else streams, "adaptive": streams is None,
                        "codec": codec, "tls": tls, "round": rnd, "status": r["status"],
                        "raw_mb": r["raw_bytes"] / 2**20,  # MiB, the unit of --size-mb
                        "wire_ratio": r["wire_bytes"] / seconds / link_bps,
                        "effective_ratio": r["raw_bytes"] / seconds / link_bps,
                        "cpu_s_per_gb": (r["cpu_s"] + r["rx_cpu_s"] - rx_cpu0) / max(r["raw_bytes"] / 1e9, 1e-9),
                        "resent_chunks": r["resent"], "seconds": seconds, "big_buffers": bool(args.big_buffers),
                        "controller_history": r.get("history"),
                        "slow_start_after_idle": bool(args.slow_start_after_idle),
                    }  # fmt: skip
                    rows.append(row)
                    label = f"adaptive({row['streams']})" if streams is None else str(streams)
                    label += " tls" if tls else ""
                    print(f"{name:16} {cc:5} {label:>12} {codec:9} {row['status']:9} wire {row['wire_ratio']:5.2f}  "
                          f"effective {row['effective_ratio']:5.2f}  cpu {row['cpu_s_per_gb']:5.1f} s/GB  "
                          f"resent {row['resent_chunks']}", flush=True)  # fmt: skip

        # --peers: Mooncake (TCP) and NIXL (UCX/TCP) over this same link; see bench/peers/wan.py
        if args.peers:
            from prfaas.bench.peers.wan import run_peers

            for row in rows:
                row.setdefault("system", "prfaas")
            rows.extend(
                {"tls": False, **row}
                for row in run_peers(
                    link,
                    name,
                    ccs=args.cc,
                    size_bytes=layers * layer_bytes,
                    data=kv_path,
                    rounds=args.peer_rounds,
                    run_timeout_s=args.run_timeout_s,
                    big_buffers=args.big_buffers,
                    slow_start_after_idle=args.slow_start_after_idle,
                )
            )


def config_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a row measured, but for TLS and the round: its TLS twin has the same key. The adaptive
    channel is its own configuration whatever stream count it settled on ("adaptive", never its count)."""
    streams = "adaptive" if row["adaptive"] else row["streams"]
    return row.get("system", "prfaas"), row["profile"], row["cc"], streams, row["codec"]


def tls_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each configuration's TLS goodput over its plaintext twin's (medians of the completed rounds),
    printed and returned: {config: [system, profile, cc, streams or "adaptive", codec], goodput_ratio,
    cpu_s_per_gb_tls, cpu_s_per_gb_plain, runs_tls, runs_plain}."""
    import statistics

    out = []
    for config in dict.fromkeys(config_key(r) for r in rows if r.get("tls")):
        by_tls = {tls: [r for r in rows if config_key(r) == config and bool(r.get("tls")) is tls
                        and r["status"] == "completed"] for tls in (False, True)}  # fmt: skip
        if by_tls[False] and by_tls[True]:
            plain, tls = (statistics.median(r["effective_ratio"] for r in by_tls[t]) for t in (False, True))
            cpu = [statistics.median(r["cpu_s_per_gb"] for r in by_tls[t]) for t in (False, True)]
            out.append({"config": list(config), "goodput_ratio": tls / plain, "cpu_s_per_gb_tls": cpu[1],
                        "cpu_s_per_gb_plain": cpu[0], "runs_tls": len(by_tls[True]),
                        "runs_plain": len(by_tls[False])})  # fmt: skip
            print(f"{' '.join(map(str, config))}: TLS/plaintext goodput {tls / plain:.2f}x (medians of "
                  f"{len(by_tls[True])}/{len(by_tls[False])}); CPU s/GB {cpu[1]:.2f} vs {cpu[0]:.2f}")  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="append", choices=sorted(PROFILES), help="default: both")
    parser.add_argument("--rtt-ms", type=float, help="custom link instead of a profile")
    parser.add_argument("--rate-mbit", type=float, default=300.0)
    parser.add_argument("--loss-pct", type=float, default=0.0)
    parser.add_argument(
        "--streams", type=int, nargs="*", default=[1, 4, 8, 16, 32, 64], help="fixed counts; none: adaptive only"
    )
    parser.add_argument("--codec", nargs="+", default=["raw", "lossless", "fp8"])
    parser.add_argument("--tls", choices=["off", "on", "both"], default="off",
                        help="over mutual TLS: on, or both (plaintext and TLS interleaved)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="measured shipments per configuration and codec")
    parser.add_argument("--cc", nargs="+", default=["cubic", "bbr"], choices=["cubic", "bbr", "reno"])
    parser.add_argument("--size-mb", type=float, default=96.0,
                        help="raw KV per measured shipment, MiB (2**20 bytes; rows' raw_mb is in MiB too)")  # fmt: skip
    parser.add_argument("--run-timeout-s", type=float, default=20.0)
    parser.add_argument("--adaptive-warmup-s", type=float, default=8.0)
    parser.add_argument("--fixed-warmup-s", type=float, default=0.0, help="the same warm-up for fixed counts")
    parser.add_argument("--big-buffers", action="store_true", help="64 MiB TCP autotuning ceiling (default 4 MiB)")
    parser.add_argument(
        "--slow-start-after-idle",
        action="store_true",
        help="keep the kernel default (1): idle pooled connections restart in slow start",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--peers", action="store_true", help="also Mooncake and NIXL (bash bench/peers/setup.sh)")
    parser.add_argument("--peer-rounds", type=int, default=1, help="timed transfers per peer and cc (--peers)")
    parser.add_argument("--_role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    parser.add_argument("--_host", help=argparse.SUPPRESS)
    parser.add_argument("--_buf", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_kv", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._role == "receiver":
        return role_receiver(args._host, args._buf)
    if args._role == "sender":
        return role_sender(args._host, args._kv)

    if args.rtt_ms is not None:
        PROFILES["custom"] = (args.rtt_ms, args.rate_mbit, args.loss_pct)
        profiles = ["custom"]
    else:
        profiles = args.profile or ["continental", "intercontinental"]
    kv_path = kv_file()
    rows: list[dict[str, Any]] = []
    try:
        for name in profiles:
            run_profile(name, args, kv_path, rows)
        tls_ratios(rows)
    finally:
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
