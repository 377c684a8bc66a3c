"""The ends of bench/wan_selftest.py's measurements, each in its own process inside a namespace
of the emulated link (`wan_selftest.py --_role recv|send|ping ...`): a bulk TCP receiver and
sender, and an ICMP echo. Each prints one JSON line with what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)  # Linux values; need CAP_NET_ADMIN
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def _set_opts(s: socket.socket, cc: str, buf: int) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
    if buf:
        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, buf)
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, buf)


def recv(a: argparse.Namespace) -> None:
    """Accept `a.streams` connections and read until `a.duration` after the first byte or `a.bytes`:
    bytes, seconds, Mbit/s and the first and last byte's CLOCK_MONOTONIC times."""
    import selectors

    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _set_opts(ls, a.cc, a.buf)  # inherited by accepted sockets (window scale needs it early)
    ls.bind((a.host, a.port))
    ls.listen(64)
    print("listening", flush=True)
    ls.settimeout(a.duration + 10)
    conns = [ls.accept()[0] for _ in range(a.streams)]
    sel = selectors.DefaultSelector()
    for c in conns:
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ)

    buf = bytearray(1 << 20)
    total, open_n = 0, len(conns)
    t_first: float | None = None
    t_last: float | None = None
    give_up = time.monotonic() + a.duration + 10
    while open_n:
        now = time.monotonic()
        if (t_first is not None and now - t_first >= a.duration) or now > give_up or total >= a.bytes:
            break
        for key, _ in sel.select(0.05):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                n = sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                n = 0
            if n == 0:
                sel.unregister(sock)
                open_n -= 1
                continue
            t_last = time.monotonic()
            if t_first is None:
                t_first = t_last
            total += n
    end = t_last if total >= a.bytes and t_last else time.monotonic()
    el = (end - t_first) if t_first else 0.0
    for c in conns:
        with contextlib.suppress(OSError):
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()
    # CLOCK_MONOTONIC is shared by all namespaces: t0/t1 line up with linkemu's t_ns
    result = {
        "bytes": total,
        "seconds": el,
        "mbit": total * 8 / el / 1e6 if el else 0.0,
        "t0": t_first or 0.0,
        "t1": end,
    }
    print(json.dumps(result), flush=True)


def _tcp_info(s: socket.socket) -> tuple[int, int]:
    """(srtt_us, total_retrans) from struct tcp_info."""
    raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    if len(raw) < 104:
        return 0, 0
    return struct.unpack_from("I", raw, 68)[0], struct.unpack_from("I", raw, 100)[0]


def send(a: argparse.Namespace) -> None:
    """Send on `a.streams` connections until the receiver resets them (or the deadline): the largest
    smoothed RTT in ms and the retransmissions, from the kernel's tcp_info."""
    socks = []
    for _ in range(a.streams):
        s = socket.socket()
        _set_opts(s, a.cc, a.buf)
        s.connect((a.host, a.port))
        socks.append(s)
    payload = memoryview(bytearray(os.urandom(1 << 16)) * 16)  # 1 MiB
    deadline = time.monotonic() + a.duration + 5
    info: list[tuple[int, int]] = [(0, 0)] * len(socks)

    def pump(i: int, s: socket.socket) -> None:
        s.settimeout(1.0)
        try:  # send until the receiver has its bytes (or time) and resets the connection
            next_info = 0.0
            while (now := time.monotonic()) < deadline:
                if now >= next_info:  # sample: counters are gone once the receiver resets us
                    info[i], next_info = _tcp_info(s), now + 0.1
                try:
                    s.send(payload)
                except TimeoutError:
                    continue
            info[i] = _tcp_info(s)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # receiver closed at its deadline
            pass

    threads = [threading.Thread(target=pump, args=(i, s)) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in socks:
        with contextlib.suppress(OSError):
            s.recv(1)  # wait for the receiver's close
        s.close()
    print(json.dumps({"srtt_ms": max(i[0] for i in info) / 1000, "retrans": sum(i[1] for i in info)}), flush=True)


def ping(a: argparse.Namespace) -> None:
    """ICMP echo over a raw socket (no ping binary needed); prints RTTs in ms."""
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(2.0)
    ident, rtts = os.getpid() & 0xFFFF, []
    for seq in range(a.count + 1):  # seq 0 warms up (first packet pays one-time costs), not reported
        body = struct.pack("!HH", ident, seq) + b"x" * 56
        hdr = struct.pack("!BBH", 8, 0, 0) + body
        csum = sum(struct.unpack(f"!{len(hdr) // 2}H", hdr))
        csum = (csum >> 16) + (csum & 0xFFFF)
        csum = ~(csum + (csum >> 16)) & 0xFFFF
        pkt = struct.pack("!BBH", 8, 0, csum) + body
        t0 = time.perf_counter()
        s.sendto(pkt, (a.host, 0))
        while True:
            try:
                data = s.recv(2048)
            except TimeoutError:
                break
            ihl = (data[0] & 0xF) * 4
            typ, _, _, rid, rseq = struct.unpack_from("!BBHHH", data, ihl)
            if typ == 0 and rid == ident and rseq == seq:
                if seq:
                    rtts.append((time.perf_counter() - t0) * 1000)
                break
        time.sleep(0.2)
    print(json.dumps({"rtts_ms": rtts}), flush=True)


ROLES: dict[str, Callable[[argparse.Namespace], None]] = {"recv": recv, "send": send, "ping": ping}
