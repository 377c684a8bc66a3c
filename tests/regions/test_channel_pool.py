"""The prefill region's KV channel pool (prefill_region/shipping.py) against destinations that never answer
(real TCP channels dialing a closed port): a channel no shipment uses is closed after IDLE_CLOSE_S, and no
more than MAX_CHANNELS are open however many destinations requests name. Before, each distinct (endpoint,
decode_region) kept a channel, a reaper, an encoder pool and a redialing thread per stream for the process's
life: 20 failed Prefills held about 690 threads."""

from __future__ import annotations

import threading
import time

import pytest

from prfaas.devstack.processes import free_port, wait_until
from prfaas.prefill_region import shipping
from prfaas.prefill_region.destination import Destination
from prfaas.prefill_region.shipping import ChannelPool
from prfaas.transport.endpoints import parse_endpoint


def _to(port: int, region: str) -> Destination:
    return Destination(parse_endpoint(f"127.0.0.1:{port}"), "ticket", "raw", decode_region=region, num_streams=2)


def test_idle_channels_close_and_at_most_max_channels_are_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipping, "MAX_CHANNELS", 4)
    monkeypatch.setattr(shipping, "IDLE_CLOSE_S", 0.3)
    threads = threading.active_count()
    pool = ChannelPool("pre")
    port = free_port()  # nothing listens there: every stream redials
    try:
        opened = [pool.get(_to(port, f"dec-{i}")) for i in range(10)]  # request-named regions, all distinct
        assert pool.num_open() == 4  # the least recently used idle ones made room
        assert all(channel.closed.is_set() for channel in opened[:6])
        again = pool.get(_to(port, "dec-9"))
        assert again is opened[9]  # the same destination, the same channel
        time.sleep(0.4)
        assert pool.path_reports() == [] and pool.num_open() == 0  # a heartbeat closes the idle ones
        wait_until(lambda: all(channel.closed.is_set() for channel in opened), timeout_s=10)
        wait_until(lambda: threading.active_count() <= threads + 2, timeout_s=15)  # their threads are gone
    finally:
        pool.close()
