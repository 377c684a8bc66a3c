"""Mooncake (TCP) and NIXL (UCX/TCP) over the emulated WAN link of bench/transport_wan.py.

    rows = run_peers(link, "continental", ccs=["cubic"], size_bytes=96 << 20)

`link` is the WanLink that bench/transport_wan.py already set up (namespaces, addresses,
sysctls): the receiver runs in namespace b at link.addr_b, the sender in namespace a, so
the bytes cross the emulator a -> b like prfaas's. The congestion control is each
namespace's default (net.ipv4.tcp_congestion_control, set per cc and restored after), as
neither library lets a caller pick it per socket. The kernel lets a namespace other than
the root one default only to a cc in the (global) net.ipv4.tcp_allowed_congestion_control,
which here holds "reno bbr": a cc missing there is added for the run and the list restored
after (it only widens what unprivileged sockets may pick). Per system and cc: a fresh pair, its
handshake, a warm-up transfer of 1/8 of the payload (prfaas warms its pool the same way),
then `rounds` timed transfers, each checked byte for byte. Rows carry transport_wan's keys
(codec "raw": neither library compresses, so wire_ratio == effective_ratio) plus `system`,
`setup_s` and `link_ip_ratio` (IP bytes the emulator carried a -> b, retransmits included,
per second / link rate). `streams` is the number of TCP connections the sender held to the
receiver after the transfer (the libraries choose it).

Standalone (own link, same sysctls as transport_wan's defaults), needs root:

    .venv/bin/python -m prfaas.bench.peers.wan --profile continental --cc cubic --size-mb 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prfaas.bench.peers.driver import PeerError, PeerPair, peers_python

CC_KEY = "net.ipv4.tcp_congestion_control"
ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


@contextlib.contextmanager
def allowed_ccs(ccs: list[str]) -> Iterator[None]:
    """Add ccs to the kernel's allowed list for the duration (namespaces may only default to those)."""
    before = ALLOWED.read_text().split()
    missing = [cc for cc in ccs if cc not in before]
    if missing:
        ALLOWED.write_text(" ".join(before + missing))
    try:
        yield
    finally:
        if missing:
            ALLOWED.write_text(" ".join(before))


def run_peers(
    link: Any,
    profile: str,
    *,
    ccs: list[str],
    size_bytes: int,
    data: str | Path | None = None,
    systems: tuple[str, ...] = ("mooncake", "nixl"),
    rounds: int = 1,
    run_timeout_s: float = 20.0,
    big_buffers: bool = False,
    slow_start_after_idle: bool = False,
    python: str | Path | None = None,
    echo: bool = True,
) -> list[dict[str, Any]]:
    """Rows for each system x cc x round; a missing .venv-peers yields no rows (and says so)."""
    py = python or peers_python()
    if py is None:
        print("# peers skipped: .venv-peers is missing (bash bench/peers/setup.sh)", flush=True)
        return []
    link_bps = link.rate_mbit * 1e6 / 8 if link.rate_mbit else float("nan")
    base = {"profile": profile, "rtt_ms": link.rtt_ms, "rate_mbit": link.rate_mbit, "loss_pct": link.loss_pct,
            "adaptive": False, "codec": "raw", "big_buffers": big_buffers, "resent_chunks": None,
            "slow_start_after_idle": slow_start_after_idle}  # fmt: skip

    def spawn(side: str, argv: list[str], **kwargs: Any) -> Any:
        return link.run_in("b" if side == "recv" else "a", argv, **kwargs)

    def ab_ip_bytes() -> int:
        return int(link.counters().get("a->b", {}).get("tx_bytes", 0))

    rows: list[dict[str, Any]] = []
    original_cc = link.read_sysctl(CC_KEY)
    with allowed_ccs(ccs), _restore_cc(link, original_cc):
        for cc in ccs:
            try:
                link.sysctl(CC_KEY, cc)
            except Exception as exc:
                print(f"# peers: cannot set {CC_KEY}={cc} in the namespaces ({exc}); skipped", flush=True)
                continue
            for system in systems:
                results: list[dict[str, Any]] = []
                setup_s = 0.0
                try:
                    with PeerPair(system, size_bytes, python=py, recv_host=link.addr_b, send_host=link.addr_a,
                                  device=link.dev, data=data, spawn=spawn, timeout_s=60) as pair:  # fmt: skip
                        setup_s = pair.setup["total_wall_s"]
                        pair.transfer(max(4096, size_bytes // 8), timeout_s=run_timeout_s)  # warm-up
                        for rnd in range(rounds):
                            ip0 = ab_ip_bytes()
                            r = pair.transfer(size_bytes, timeout_s=run_timeout_s)
                            r["ip_bytes"], r["round"] = ab_ip_bytes() - ip0, rnd
                            results.append(r)
                except PeerError as exc:
                    err = str(exc)
                    status = "timeout" if "no answer within" in err or "Timeout" in err else "failed"
                    results.append({"ok": False, "error": err[:600], "status": status, "seconds": 0.0,
                                    "tcp_conns": 0, "round": len(results)})  # fmt: skip
                for r in results:
                    seconds = max(float(r["seconds"]), 1e-9)
                    ok = bool(r["ok"])
                    moved = size_bytes if ok else 0
                    cpu = float(r.get("cpu_s_send", 0.0)) + float(r.get("cpu_s_recv", 0.0))
                    status = "completed" if ok else r.get("status", "failed")
                    row = {
                        **base, "system": system, "cc": cc, "streams": r["tcp_conns"], "status": status,
                        "raw_mb": moved / 2**20, "wire_ratio": moved / seconds / link_bps,  # MiB, as transport_wan
                        "effective_ratio": moved / seconds / link_bps,
                        "cpu_s_per_gb": cpu / (moved / 1e9) if moved else None,
                        "seconds": r["seconds"], "setup_s": setup_s, "round": r["round"],
                        "link_ip_ratio": r.get("ip_bytes", 0) / seconds / link_bps if ok else None,
                        "error": r.get("error", ""),
                    }  # fmt: skip
                    rows.append(row)
                    if echo:
                        label = f"{system}({row['streams']})"
                        cpu_txt = f"{row['cpu_s_per_gb']:5.1f}" if row["cpu_s_per_gb"] is not None else "    -"
                        err = f"  {row['error'][:300]}" if row["error"] else ""
                        print(f"{profile:16} {cc:5} {label:>12} {'raw':9} {status:9} wire {row['wire_ratio']:5.2f}  "
                              f"effective {row['effective_ratio']:5.2f}  cpu {cpu_txt} s/GB  "
                              f"setup {setup_s:4.1f} s{err}", flush=True)  # fmt: skip
    return rows


@contextlib.contextmanager
def _restore_cc(link: Any, original: str) -> Iterator[None]:
    try:
        yield
    finally:
        link.sysctl(CC_KEY, original)


def main() -> None:
    from prfaas.devstack.wanlink import PROFILES, wan_link

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="continental", choices=["continental", "intercontinental"])
    p.add_argument("--cc", nargs="+", default=["cubic"], choices=["cubic", "bbr", "reno"])
    p.add_argument("--systems", nargs="+", default=["mooncake", "nixl"], choices=["mooncake", "nixl"])
    p.add_argument("--size-mb", type=float, default=16.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--run-timeout-s", type=float, default=20.0)
    p.add_argument("--data", help=".npy/.npz payload (default: random bytes)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    rtt_ms, rate_mbit, loss_pct = PROFILES[a.profile]
    with wan_link(rtt_ms=rtt_ms, rate_mbit=rate_mbit, loss_pct=loss_pct) as link:
        link.sysctl("net.ipv4.tcp_slow_start_after_idle", "0")  # as bench/transport_wan.py does by default
        rows = run_peers(link, a.profile, ccs=a.cc, size_bytes=int(a.size_mb * 2**20), data=a.data,
                         systems=tuple(a.systems), rounds=a.rounds, run_timeout_s=a.run_timeout_s)  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
