"""What a TCP channel measures on its path (transport/pathmeter.py), over an emulated WAN link
(two network namespaces joined by the userspace link emulator): the goodput of backlogged
windows converges within 20% of the emulated rate, the minimum RTT is the emulated one, and a
sender that has nothing to send measures no goodput. Needs root (namespaces, TUN devices)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import netns_kit
import pytest
from transport_kit import Kit, fill, layers_for

from prfaas.devstack.wanlink import WanLink, wan_link
from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.pathmeter import PathMeter
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tcp_sender import TcpChannel

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces and TUN devices")

RTT_MS, RATE_MBIT = 40.0, 80.0  # under the 300 Mbit/s this host's CPU can emulate


@pytest.fixture
def link() -> Iterator[WanLink]:
    with wan_link(RTT_MS, RATE_MBIT, 0.0, name_prefix="pfm") as wan:
        yield wan


@needs_root
def test_backlogged_goodput_converges_on_the_emulated_rate(kit: Kit, link: WanLink) -> None:
    receiver = netns_kit.call_in(link.ns_b, lambda: TcpReceiver(kit.verifier, link.addr_b, 0))
    spec = kit.spec(num_layers=40, shape=(4, 1024, 64), timeout_s=60.0, chunk_bytes=256 << 10)  # 40 MiB: ~4.5 s
    with receiver:
        address = (link.addr_b, receiver.address[1])
        channel = netns_kit.call_in(link.ns_a, lambda: TcpChannel(address, num_streams=4))
        with channel:
            inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=spec.timeout_s)
            shipment = Shipment(spec)
            transfer = channel.submit(shipment)
            fill(shipment, layers_for(spec))  # all at once: the path, not the producer, is the limit
            assert transfer.wait(60) is TransferStatus.COMPLETED, transfer.error
            assert inbound.wait(5) is TransferStatus.COMPLETED
            time.sleep(1.0)  # the window in flight closes
            busy = channel.meter.take()
            time.sleep(1.5)  # idle: windows close with nothing to send
            idle = channel.meter.take()

    assert busy is not None and busy.goodput_bytes_per_s is not None
    goodput_mbit = busy.goodput_bytes_per_s * 8 / 1e6
    print(f"\ngoodput {goodput_mbit:.1f} Mbit/s over {busy.backlogged_s:.1f} s backlogged (emulated {RATE_MBIT:g}); "
          f"min RTT {1e3 * (busy.min_rtt_s or 0):.1f} ms, srtt {1e3 * (busy.srtt_s or 0):.1f} ms, "
          f"{busy.retransmits} retransmits")  # fmt: skip
    assert abs(goodput_mbit - RATE_MBIT) <= 0.2 * RATE_MBIT
    assert busy.bytes_acked >= spec.raw_bytes
    assert busy.min_rtt_s is not None and RTT_MS * 0.9 <= 1e3 * busy.min_rtt_s <= RTT_MS * 1.5
    assert idle is not None and idle.goodput_bytes_per_s is None and idle.backlogged_s == 0


def test_a_meter_hands_each_window_once() -> None:
    meter = PathMeter()
    assert meter.take() is None
    meter.add(0.5, 1000, backlogged=True, srtt_s=0.05, min_rtt_s=0.04, retransmits=2)
    meter.add(0.5, 100, backlogged=False, srtt_s=0.07, min_rtt_s=0.03)
    report = meter.take()
    assert report is not None and meter.take() is None
    assert (report.seconds, report.bytes_acked, report.backlogged_bytes, report.retransmits) == (1.0, 1100, 1000, 2)
    assert report.goodput_bytes_per_s == 2000.0 and report.rate_bytes_per_s == 1100.0
    assert report.min_rtt_s == 0.03 and report.srtt_s == pytest.approx(0.06)
