"""Link outages: shipments over an emulated WAN link (two network namespaces joined by the
userspace link emulator, devstack/wanlink.py) that is cut, every packet dropped both ways,
and restored. A transfer rides the outage out on the same attempt, resending at most what was
in flight; only its deadline fails it. Needs root (namespaces, TUN devices).

Measured figures are printed (`pytest -s`); docs/transports.md "Link outages" records them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import netns_kit
import pytest
from transport_kit import Kit, fill, layers_for

from prfaas.devstack.wanlink import WanLink, wan_link
from prfaas.transport.api import Shipment, TransferStatus
from prfaas.transport.errors import TransferTimeout
from prfaas.transport.framing import HEADER_SIZE
from prfaas.transport.outbound import OutboundTransfer
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tcp_sender import TcpChannel

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces and TUN devices")

RTT_MS, RATE_MBIT = 20.0, 100.0  # a short WAN hop: the test is about the outage, not the path
WINDOW = 4 << 20  # the channel's max_inflight_bytes: the most a resume may send again


@pytest.fixture
def link() -> Iterator[WanLink]:
    with wan_link(RTT_MS, RATE_MBIT, 0.0, name_prefix="pfo") as wan:
        yield wan


@pytest.fixture
def receiver(link: WanLink, kit: Kit) -> Iterator[TcpReceiver]:
    rx = netns_kit.call_in(link.ns_b, lambda: TcpReceiver(kit.verifier, link.addr_b, 0))
    with rx:
        yield rx


def channel_in(link: WanLink, receiver: TcpReceiver, num_streams: int | None = 4) -> TcpChannel:
    """A sender in namespace a: its streams cross the emulated link."""
    address = (link.addr_b, receiver.address[1])
    return netns_kit.call_in(link.ns_a, lambda: TcpChannel(address, num_streams=num_streams, max_inflight_bytes=WINDOW))


def next_ack_s(transfer: OutboundTransfer, since: float, timeout_s: float) -> float:
    """Seconds from `since` until the transfer's acknowledged bytes next grow."""
    start, end = transfer.stats.raw_bytes, time.monotonic() + timeout_s
    while transfer.stats.raw_bytes == start and time.monotonic() < end and not transfer.status().terminal:
        time.sleep(0.005)
    return time.monotonic() - since


@pytest.mark.parametrize(
    ("num_streams", "outage_s"),
    [(4, 5.0), (None, 5.0), (4, 12.0)],  # None: the adaptive default; 12 s outlasts a send's 10 s timeout
    ids=["4-streams-5s", "adaptive-5s", "4-streams-12s"],
)
def test_a_cut_mid_shipment_resumes_the_same_transfer_from_its_acknowledged_chunks(
    kit: Kit, link: WanLink, receiver: TcpReceiver, num_streams: int | None, outage_s: float
) -> None:
    spec = kit.spec(num_layers=24, shape=(4, 1024, 64), timeout_s=60.0, chunk_bytes=256 << 10)  # 24 MiB
    layers = layers_for(spec)
    inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=spec.timeout_s)
    with channel_in(link, receiver, num_streams) as channel:
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        fill(shipment, layers)
        deadline = time.monotonic() + 20
        while transfer.stats.raw_bytes < spec.raw_bytes // 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert transfer.status() is TransferStatus.IN_FLIGHT, transfer.error
        acked_at_cut = transfer.stats.raw_bytes
        cut_at = link.cut()
        time.sleep(outage_s)
        assert transfer.status() is TransferStatus.IN_FLIGHT, transfer.error  # the same attempt goes on
        assert transfer.stats.raw_bytes < spec.raw_bytes
        restored_at = link.restore()
        resumed_s = next_ack_s(transfer, restored_at, 15)
        assert transfer.wait(30) is TransferStatus.COMPLETED, transfer.error
        done_s = time.monotonic() - restored_at
        assert inbound.wait(5) is TransferStatus.COMPLETED
        assert [inbound.layer(i, 1) for i in range(spec.num_layers)] == layers  # bit-exact
        stats = transfer.stats
        print(
            f"\noutage {restored_at - cut_at:.2f} s at {acked_at_cut / spec.raw_bytes:.0%} acked: "
            f"resent {stats.resent_bytes} B in {stats.resent_chunks} chunks (window {WINDOW} B); "
            f"first ACK {resumed_s:.2f} s, completed {done_s:.2f} s after the link came back "
            f"({(spec.raw_bytes - acked_at_cut) / 2**20:.1f} MiB left at the cut)"
        )
        # unacknowledged chunks again, acknowledged ones never: the window bounds their payload in flight,
        # and each frame sent again carries its header too (16 chunks at the cut: 4 MiB + 16 x 64 B)
        assert 0 < stats.resent_bytes <= WINDOW + stats.resent_chunks * HEADER_SIZE
        # backoff is at most 2 s and the pool's streams probe at jittered times (measured 0.25-0.71 s
        # idle; the bounds leave room for a loaded 2-core CI host)
        assert resumed_s < 4.0
        assert done_s < 12.0  # ~1.5 s of data left at 100 Mbit/s (measured 1.8-2.3 s)


def test_a_cut_before_the_first_connection_is_waited_out(kit: Kit, link: WanLink, receiver: TcpReceiver) -> None:
    """Before, once every stream's connection attempts had timed out for 5 s
    (`unavailable_after_s`, counted from the first 3 s connect timeout) the transfer FAILED
    with PeerUnavailable, about 9 s into a cut of a link that was merely down."""
    spec = kit.spec(num_layers=4, timeout_s=30.0)
    layers = layers_for(spec)
    inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=spec.timeout_s)
    link.cut()
    with channel_in(link, receiver) as channel:
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        fill(shipment, layers)
        time.sleep(12.0)
        assert transfer.status() is TransferStatus.IN_FLIGHT, transfer.error
        restored_at = link.restore()
        assert transfer.wait(20) is TransferStatus.COMPLETED, transfer.error
        print(f"\ncompleted {time.monotonic() - restored_at:.2f} s after a 12 s cut from the start ended")
        assert [inbound.layer(i, 1) for i in range(spec.num_layers)] == layers


def test_a_cut_past_the_deadline_times_out_at_the_deadline(kit: Kit, link: WanLink, receiver: TcpReceiver) -> None:
    """Before, the sender's CANCEL queued behind a send stalled on the dead path, in the thread
    that waited: `wait` returned TIMEOUT up to 2 x SEND_TIMEOUT_S (measured 14.8 s) late."""
    spec = kit.spec(num_layers=24, shape=(4, 1024, 64), timeout_s=6.0, chunk_bytes=256 << 10)
    layers = layers_for(spec)
    receiver.expect(spec.job_id, spec.attempt, timeout_s=spec.timeout_s)
    channel = channel_in(link, receiver)
    try:
        shipment = Shipment(spec)
        transfer = channel.submit(shipment)
        due = transfer.cell.deadline
        fill(shipment, layers)
        while transfer.stats.raw_bytes < spec.raw_bytes // 8 and time.monotonic() < due:
            time.sleep(0.005)
        link.cut()  # for good
        assert transfer.wait(15) is TransferStatus.TIMEOUT, transfer.error
        late_s = time.monotonic() - due
        assert isinstance(transfer.error, TransferTimeout)
        print(f"\ntimed out {late_s * 1e3:.0f} ms after its deadline")
        assert -0.05 < late_s < 0.5
    finally:
        start = time.monotonic()
        channel.close()
        assert time.monotonic() - start < 8.0
