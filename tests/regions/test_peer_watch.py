"""The decode region's watch on prefill regions: one shared health stream per region, every
waiting reservation told once when it breaks, none after it stopped watching."""

from __future__ import annotations

import threading

from region_kit import wait_until

from prfaas.decode_region.peer_watch import PeerWatcher
from prfaas.protos.region_server import RegionServer


def test_watches_share_one_stream_and_all_hear_of_its_loss() -> None:
    server = RegionServer("127.0.0.1:0", {})
    server.start()
    watcher = PeerWatcher(0.2)
    lost: dict[str, str] = {}
    lock = threading.Lock()

    def on_lost(name: str):  # type: ignore[no-untyped-def]
        def record(reason: str) -> None:
            with lock:
                assert name not in lost, f"{name} told twice"
                lost[name] = reason

        return record

    try:
        watches = {name: watcher.watch(server.grpc_address, on_lost(name)) for name in "abcd"}
        assert watcher.streams == 1
        watches["c"].stop()  # its KV arrived: no longer waiting
        server.stop(0)
        wait_until(lambda: len(lost) == 3, 10.0)
        assert sorted(lost) == ["a", "b", "d"]
        assert all(f"prefill region {server.grpc_address} is unavailable" in why for why in lost.values())
        wait_until(lambda: watcher.streams == 0, 5.0)

        late = watcher.watch(server.grpc_address, on_lost("late"))  # a new stream to a dead region
        wait_until(lambda: "late" in lost, 10.0)
        late.stop()
    finally:
        watcher.close()
        server.stop(0)


def test_close_tells_no_one() -> None:
    server = RegionServer("127.0.0.1:0", {})
    server.start()
    watcher = PeerWatcher(0.2)
    lost: list[str] = []
    try:
        watcher.watch(server.grpc_address, lost.append)
        watcher.watch(server.grpc_address, lost.append)
        watcher.close()
        server.stop(0)
        assert watcher.streams == 0
        threading.Event().wait(1.0)
        assert lost == []
    finally:
        server.stop(0)
