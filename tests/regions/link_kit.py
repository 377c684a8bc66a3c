"""Helpers for the tests of a region's links to the control plane and its peers: a TCP proxy that
can go silent (a partition, a host gone: no FIN, no RST), and a registry stand-in that hands out
WebRTC offers (a real gRPC server)."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from prfaas.protos.prfaas.v1 import registry_pb2, registry_pb2_grpc


class FreezingProxy:
    """Forwards TCP connections to `backend` ("host:port"). `freeze()`: the connections open now stop
    carrying bytes either way and stay open; new ones go to `backend` (which may be changed)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._frozen: list[threading.Event] = []
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="test-proxy", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host, port = self.backend.rsplit(":", 1)
            try:
                upstream = socket.create_connection((host, int(port)), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            frozen = threading.Event()
            self._frozen.append(frozen)
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, frozen), name="test-proxy-pump", daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, frozen: threading.Event) -> None:
        try:
            while True:
                data = a.recv(65536)
                if frozen.is_set():
                    self._closed.wait()  # hold both sockets open, forward nothing (not even an end)
                    return
                if not data:
                    b.shutdown(socket.SHUT_WR)
                    return
                b.sendall(data)
        except OSError:
            if not frozen.is_set():
                a.close()
                b.close()

    @property
    def num_connections(self) -> int:
        return len(self._frozen)

    def freeze(self) -> None:
        for frozen in self._frozen:
            frozen.set()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._sockets:
            s.close()


class OfferDesk(registry_pb2_grpc.RegistryServicer):
    """The registry's WebRTC signalling as a region's OfferListener sees it: `offers` go out on the
    Offers streams, `answers` come back. `stall`: Offers calls that send nothing until they end."""

    def __init__(self, stall: int = 0) -> None:
        self.offers: queue.Queue[registry_pb2.SignalOffer] = queue.Queue()
        self.answers: list[registry_pb2.SignalAnswer] = []
        self.calls = 0  # Offers calls opened
        self.stall = stall

    def Offers(self, request: registry_pb2.OffersRequest, context: Any) -> Iterator[registry_pb2.SignalOffer]:
        self.calls += 1
        stalled = self.calls <= self.stall
        while context.is_active():
            try:
                offer = None if stalled else self.offers.get(timeout=0.05)
            except queue.Empty:
                continue
            if offer is None:
                time.sleep(0.05)
            else:
                yield offer

    def Answer(self, request: registry_pb2.SignalAnswer, context: Any) -> registry_pb2.AnswerReply:
        self.answers.append(request)
        return registry_pb2.AnswerReply()

    def answered(self, offer_id: str) -> bool:
        return any(a.id == offer_id for a in self.answers)


def serve_desk(desk: OfferDesk) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(8))
    registry_pb2_grpc.add_RegistryServicer_to_server(desk, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"
