"""A reservation whose prefill region stops answering ends with a status of its own, ABORTED
(`PrefillLost`), which the control plane reads as "the prefill instance failed": not UNAVAILABLE,
what a decode region down or draining answers. Before, it ended UNAVAILABLE: the API suspected
and left out the healthy decode instance, and reshipped from the hung prefill one; with one
decode region the job failed at its deadline ("no decode region")."""

from __future__ import annotations

import threading
import uuid

import grpc
from decode_kit import Context, ScriptedBackend, decode_request, drain, reserve_request
from region_kit import wait_until

from prfaas.decode_region.agent import DecodeAgent
from prfaas.region.server import RegionServer


def test_a_decode_waiting_on_a_lost_prefill_region_ends_aborted_not_unavailable() -> None:
    prefill = RegionServer("127.0.0.1:0", {})  # its health service: what the decode region watches
    prefill.start()
    agent = DecodeAgent(ScriptedBackend(), kv_buffer_bytes=1000, heartbeat_interval_s=0.2)
    ended: list[tuple[int, grpc.StatusCode, str]] = []
    try:
        job_id = str(uuid.uuid4())
        agent.Reserve(reserve_request(job_id, 400, prefill_grpc=prefill.grpc_address), Context())
        wait_until(lambda: agent.watcher.answered(prefill.grpc_address), 20.0)
        decoding = threading.Thread(target=lambda: ended.append(drain(agent.Decode(decode_request(job_id), Context()))))
        decoding.start()  # waits for the KV, which the prefill region owes
        prefill.stop(0)
        decoding.join(20.0)
        assert ended, "the Decode still waits"
        num_events, code, details = ended[0]
        assert (num_events, code) == (0, grpc.StatusCode.ABORTED), ended  # UNAVAILABLE before
        assert f"prefill region {prefill.grpc_address} is unavailable" in details
        assert agent.book.used_bytes == 0
        late = drain(agent.Decode(decode_request(job_id), Context()))  # the tombstone keeps the status
        assert late[1] == grpc.StatusCode.ABORTED
    finally:
        agent.close()
        prefill.stop(0)
