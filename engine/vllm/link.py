"""The prfaas transport endpoints of one vLLM engine, shared by its connector and its host.

vLLM builds the connector itself from `kv_transfer_config`, so the process that hosts
the engine cannot hand it objects. Both meet here instead, by the engine's `engine_id`:
the worker-side connector creates the `KVLink` (KV receiver port, outbound channels);
the host registers the shipments a decode will wait for (`expect`) *before* it hands the
request to vLLM, so a shipment that arrives first is never refused, waits for a
prefill's shipment outcome (`wait_shipped`), and cancels a prefill's shipment when its job
ends (`cancel_shipment`). Only meaningful when the engine core runs in the host's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which `VLLMHost` sets).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas.transport.api import TransferStatus
from prfaas.transport.inbound import Inbound
from prfaas.transport.outbound import OutboundTransfer
from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tcp_sender import TcpChannel
from prfaas.transport.tickets import TicketVerifier
from prfaas.transport.tls import NodeCert, client_context, server_context

ENDED_KEPT = 1024  # failed registrations remembered for a Decode that comes after (`KVLink.take`)
SHIP_CANCELS_KEPT = 4096  # canceled shipments remembered, so one whose transfer opens after is canceled as it opens


@dataclass(frozen=True)
class ShipOutcome:
    status: TransferStatus
    raw_bytes: int
    wire_bytes: int
    seconds: float
    error: str | None
    error_type: str | None = None  # the transport error's class name (TicketRejected, PeerUnavailable, ...)


class KVLink:
    """Receiver (optional) and outbound channels of one engine; with `tls` (the engine's
    certificate: transport/tls.py) both speak mutual TLS, and the receiver accepts only
    prefill-region certificates (transport/tcp_receiver.py)."""

    def __init__(
        self, node: str, verifier: TicketVerifier | None, host: str, port: int, tls: NodeCert | None = None
    ) -> None:
        self.node = node
        self._client_tls = client_context(tls) if tls is not None else None
        server_tls = server_context(tls) if tls is not None else None
        self.receiver = (
            TcpReceiver(verifier, host, port, node=node, ssl_context=server_tls) if verifier is not None else None
        )
        self._lock = threading.Condition()
        self._expected: dict[tuple[str, int], Inbound] = {}
        # registrations whose shipment failed before a request took it, the most recent ENDED_KEPT: a Decode
        # that comes after (the control plane sends it at prefill_done) fails its load at once, instead of
        # registering afresh and waiting its whole deadline for a shipment the receiver already refused
        self._ended: OrderedDict[tuple[str, int], Inbound] = OrderedDict()
        self._channels: dict[tuple[tuple[str, int], str | None], TcpChannel] = {}
        self._outcomes: dict[tuple[str, int], ShipOutcome] = {}  # (job id, attempt) -> how its shipment ended
        self._sending: dict[tuple[str, int], list[OutboundTransfer]] = {}  # (job id, attempt) -> live transfers
        self._ship_canceled: OrderedDict[tuple[str, int], None] = OrderedDict()  # the most recent SHIP_CANCELS_KEPT
        # Set when the connector's background work ends (a load, a shipment) and when a
        # request arrives: the host's loop waits on it instead of stepping an engine that has
        # nothing to run.
        self.activity = threading.Event()

    @property
    def kv_address(self) -> tuple[str, int] | None:
        return self.receiver.address if self.receiver is not None else None

    def expect(
        self, job_id: str, attempt: int, timeout_s: float, *, tenant: str | None = None, max_bytes: int | None = None
    ) -> Inbound:
        """Register a shipment now (the decode region's reservation: its `tenant` and
        `max_bytes` are checked at OPEN, `Receiver.expect`); the connector's load picks it up
        (`take`). Idempotent: a second call returns the first registration."""
        if self.receiver is None:
            raise RuntimeError("this engine has no KV receiver (kv_connector_extra_config.ticket_keys is unset)")
        key = (job_id, attempt)
        with self._lock:
            inbound = self._expected.get(key)
            if inbound is not None:
                return inbound
            self._ended.pop(key, None)  # a new reservation of the attempt: its shipment may come now
            inbound = self._expected[key] = self.receiver.expect(
                job_id, attempt, timeout_s, tenant=tenant, max_bytes=max_bytes
            )
        inbound.cell.on_terminal(lambda status: self._forget_failed(key, status))
        return inbound

    def attach(self, job_id: str, attempt: int, timeout_s: float) -> Inbound:
        """The registration a request will load from (the host, as it submits it): its reservation's, live or
        failed before the request came (its load then fails at once), else a new one (`expect`)."""
        with self._lock:
            inbound = self._expected.get((job_id, attempt)) or self._ended.get((job_id, attempt))
        return inbound if inbound is not None else self.expect(job_id, attempt, timeout_s)

    def _forget_failed(self, key: tuple[str, int], status: TransferStatus) -> None:
        """A reservation whose shipment failed or expired before a request took it: drop it
        (the transport already dropped its KV). A completed one waits for its request."""
        if status is not TransferStatus.COMPLETED:
            with self._lock:
                inbound = self._expected.pop(key, None)
                if inbound is not None:
                    self._ended[key] = inbound
                    while len(self._ended) > ENDED_KEPT:
                        self._ended.popitem(last=False)

    def forget(self, job_id: str, attempt: int) -> bool:
        """Drop a registration no request took (the reservation ended): its shipment is
        refused or stopped and its KV freed. False if there was none (taken, or never made)."""
        with self._lock:
            inbound = self._expected.pop((job_id, attempt), None)
            self._ended.pop((job_id, attempt), None)
        if inbound is None:
            return False
        inbound.cancel("reservation ended")
        inbound.release()
        return True

    def take(self, job_id: str, attempt: int, timeout_s: float) -> Inbound:
        """The shipment the host registered, or a new registration (the request came first)."""
        with self._lock:
            inbound = self._expected.pop((job_id, attempt), None) or self._ended.pop((job_id, attempt), None)
        return inbound if inbound is not None else self.expect_untracked(job_id, attempt, timeout_s)

    def expect_untracked(self, job_id: str, attempt: int, timeout_s: float) -> Inbound:
        if self.receiver is None:
            raise RuntimeError("this engine has no KV receiver (kv_connector_extra_config.ticket_keys is unset)")
        return self.receiver.expect(job_id, attempt, timeout_s)

    def channel(self, address: tuple[str, int], server_name: str | None = None) -> TcpChannel:
        """The pooled channel to a decode region's KV port; over TLS its certificate must name
        `server_name` (None: the address)."""
        key = (address, server_name)
        with self._lock:
            channel = self._channels.get(key)
            if channel is None or channel.closed.is_set():
                channel = self._channels[key] = TcpChannel(
                    address, node=self.node, ssl_context=self._client_tls, server_hostname=server_name
                )
            return channel

    def sending(self, job_id: str, attempt: int, transfer: OutboundTransfer) -> None:
        """The connector opened `transfer` for that attempt's shipment: `cancel_shipment` reaches it until it
        ends. Canceled at once if the shipment was canceled before (its job ended while vLLM computed it)."""
        key = (job_id, attempt)
        with self._lock:
            canceled = key in self._ship_canceled
            if not canceled:
                self._sending.setdefault(key, []).append(transfer)
        if canceled:
            transfer.cancel()
            return
        transfer.cell.on_terminal(lambda _status: self._sent(key, transfer))
        if transfer.status().terminal:  # ended before the callback was in place: it will not come
            self._sent(key, transfer)

    def _sent(self, key: tuple[str, int], transfer: OutboundTransfer) -> None:
        with self._lock:
            live = [t for t in self._sending.get(key, ()) if t is not transfer]
            if live:
                self._sending[key] = live
            else:
                self._sending.pop(key, None)

    def cancel_shipment(self, job_id: str, attempt: int) -> bool:
        """Cancel that attempt's outbound shipment (its prefill job ended: canceled, past its deadline, its
        caller gone): a transfer in flight ends CANCELED and its receiver is sent CANCEL; the connector then
        frees the blocks and records the outcome (`wait_shipped`) as for any other end. One that opens later
        is canceled as it opens. Idempotent, and harmless when the shipment already ended or never started.
        True if a live transfer was canceled."""
        key = (job_id, attempt)
        with self._lock:
            self._ship_canceled[key] = None
            self._ship_canceled.move_to_end(key)
            while len(self._ship_canceled) > SHIP_CANCELS_KEPT:
                self._ship_canceled.popitem(last=False)
            live = [t for t in self._sending.pop(key, ()) if not t.status().terminal]
        for transfer in live:
            transfer.cancel()
        return bool(live)

    def record_shipped(self, job_id: str, attempt: int, outcome: ShipOutcome) -> None:
        with self._lock:
            self._outcomes[(job_id, attempt)] = outcome
            while len(self._outcomes) > 4096:  # oldest first: hosts collect theirs promptly
                del self._outcomes[next(iter(self._outcomes))]
            self._lock.notify_all()

    def wait_shipped(self, job_id: str, attempt: int, timeout_s: float) -> ShipOutcome | None:
        """The outcome of that attempt's shipment, or None if it has not ended in `timeout_s`. By attempt: an
        earlier attempt's outcome, left unread when its prefill stopped waiting, is never a later one's."""
        deadline = time.monotonic() + timeout_s
        key = (job_id, attempt)
        with self._lock:
            while key not in self._outcomes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(remaining)
            return self._outcomes.pop(key)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            expected, self._expected = list(self._expected.values()), {}
        for inbound in expected:
            inbound.cancel("engine shutting down")
            inbound.release()
        for channel in channels:
            channel.close()
        if self.receiver is not None:
            self.receiver.close()


class LinkRegistry:
    """engine_id -> KVLink for this process (see the module docstring for why it exists)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[str, KVLink] = {}

    def open(self, engine_id: str, node: str, verifier: TicketVerifier | None, host: str, port: int,
             tls: NodeCert | None = None) -> KVLink:  # fmt: skip
        with self._lock:
            link = self._links.get(engine_id)
            if link is None:
                link = self._links[engine_id] = KVLink(node, verifier, host, port, tls)
            return link

    def open_configured(self, engine_id: str, extra: dict[str, Any]) -> KVLink:
        """`open` from the connector's `kv_connector_extra_config`: `node`, `kv_host`, `kv_port`,
        `ticket_keys` ({kid: hex}; none: no receiver) and `tls` ({"cert", "key", "ca"} paths; none: plaintext)."""
        keys, files = extra.get("ticket_keys"), extra.get("tls")
        verifier = TicketVerifier({str(k): bytes.fromhex(str(v)) for k, v in dict(keys).items()}) if keys else None
        tls = NodeCert(Path(files["cert"]), Path(files["key"]), Path(files["ca"])) if files else None
        node = str(extra.get("node", f"vllm-{engine_id[:8]}"))
        host, port = str(extra.get("kv_host", "127.0.0.1")), int(extra.get("kv_port", 0))
        return self.open(engine_id, node, verifier, host, port, tls)

    def get(self, engine_id: str) -> KVLink:
        with self._lock:
            link = self._links.get(engine_id)
        if link is None:
            raise LookupError(f"no vLLM engine {engine_id!r} with the prfaas connector runs in this process")
        return link

    def close(self, engine_id: str) -> None:
        with self._lock:
            link = self._links.pop(engine_id, None)
        if link is not None:
            link.close()


LINKS = LinkRegistry()
