"""`prefill-t` and `decode-t`, one instance each (`i0`): a test's own servicers on real gRPC servers (one asyncio
loop on a thread of its own), registered in the fleet and beating every 0.5 s, so the dispatcher and the sweeper
reach them as they reach regions, and each fault happens at the moment a test sets."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc

from prfaas.control_plane.fleet.registry import RegionRegistry
from prfaas.control_plane.scheduling.snapshot import Link
from prfaas.protos.prfaas.v1 import decode_pb2_grpc, prefill_pb2_grpc, registry_pb2


class FakeRegions:
    def __init__(self, registry: RegionRegistry, prefill: Any, decode: Any) -> None:
        self.prefill, self.decode = prefill, decode
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.servers: list[grpc.aio.Server] = []
        ports = asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(10)
        self.registry = registry
        self.tokens = {role: self._register(role, port) for role, port in ports.items()}
        registry.set_link(Link(src="prefill-t", dst="decode-t", rtt_ms=1.0, bandwidth_gbps=10.0))
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, daemon=True)
        self._beats.start()

    async def _serve(self) -> dict[str, int]:
        ports = {}
        servicers = (("prefill", prefill_pb2_grpc.add_PrefillRegionServicer_to_server, self.prefill),
                     ("decode", decode_pb2_grpc.add_DecodeRegionServicer_to_server, self.decode))  # fmt: skip
        for role, add, servicer in servicers:
            server = grpc.aio.server()
            add(servicer, server)  # type: ignore[operator]
            ports[role] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
        return ports

    def _register(self, role: str, port: int) -> str:
        return self.registry.register(registry_pb2.RegisterRequest(
            name=f"{role}-t", role=role, num_workers=1, usd_per_gpu_hour=0.5 if role == "prefill" else 4.0,
            grpc_endpoint=f"127.0.0.1:{port}", kv_endpoint="127.0.0.1:9" if role == "decode" else "",
            model="tiny-llama", kv_buffer_bytes=1 << 40, heartbeat_interval_s=0.5, instance="i0",
        ))  # fmt: skip

    def _beat(self) -> None:
        while not self._stop.wait(0.5):
            for role, token in self.tokens.items():
                load = registry_pb2.Load(kv_free_bytes=1 << 40)
                self.registry.heartbeat(registry_pb2.HeartbeatRequest(name=f"{role}-t", region_id=token,
                                                                      instance="i0", load=load))  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        self._beats.join(5)
        for server in self.servers:
            asyncio.run_coroutine_threadsafe(server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
