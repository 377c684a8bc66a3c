"""The prefill agent of a region with `engine: vllm`: the same gRPC surface, queue, events,
deadlines and cancel as the HF agent (it is one), with the job run by the region's vLLM
server. A job is one vLLM request for one token carrying `prfaas_ship` params: the prfaas
connector ships each layer's KV to the decode region as vLLM computes it, or, to a decode
region on the same machine, all of it right after the forward (`vllm.ship`; the wire format
of the HF agent's shipments, so either engine decodes it); the agent then waits for the
shipment's outcome. vLLM frees the KV once it is shipped, so there is no lease to Reship.
"""

from __future__ import annotations

import time
from typing import Any

from prfaas.engine.kv import hash_token_ids
from prfaas.engine.vllm_params import ShipParams, layerwise_for
from prfaas.engine.vllm_remote import VLLMEngine, check_greedy, shipment_error
from prfaas.prefill_region.agent import PrefillAgent, _Job, _Stop
from prfaas.prefill_region.shipping import Destination
from prfaas.protos.prfaas.v1 import common_pb2, prefill_pb2
from prfaas.protos.rpc import InvalidRequest, NotFound, sampling_from_proto, unary
from prfaas.transport.endpoints import parse_endpoints


class VLLMPrefillAgent(PrefillAgent):
    def __init__(self, engine: VLLMEngine, *, ship: str = "auto", **options: Any) -> None:
        layerwise_for("127.0.0.1", ship)  # a bad setting fails here, not on the first job
        self.vllm = engine
        self.ship = ship
        super().__init__(engine, **options)  # type: ignore[arg-type]  # the shared paths read only model facts

    def _validate(self, request: prefill_pb2.PrefillRequest) -> tuple[list[int], Destination]:
        token_ids, destination = super()._validate(request)
        check_greedy(sampling_from_proto(request.sampling))
        tcp = [e for e in parse_endpoints(request.destination.kv_endpoint) if e.kind == "tcp"]
        if not tcp:
            raise InvalidRequest(
                f"destination.kv_endpoint {request.destination.kv_endpoint!r} has no TCP endpoint: a vLLM prefill "
                "region ships KV over TCP only"
            )
        return token_ids, Destination(tcp[0], destination.ticket, destination.codec)

    def _prefill_and_ship(self, job: _Job) -> None:
        job.emit(started=prefill_pb2.Started(queued_s=time.monotonic() - job.started))
        self._check(job)
        address = job.destination.address
        ship = ShipParams(job.job_id, job.attempt, job.destination.ticket, f"{address.host}:{address.port}",
                          job.destination.codec, min(3600.0, job.deadline - time.monotonic()),
                          layerwise_for(address.host, self.ship))  # fmt: skip
        kv_params = ship.to_kv_params()
        t0 = time.monotonic()
        result = self.vllm.generate(job.token_ids, 1, kv_params, timeout_s=max(0.1, job.deadline - t0))
        prefill_s = time.monotonic() - t0
        self._count_tokens(len(job.token_ids), prefill_s)
        self._check(job)
        first = int(result["token_ids"][0])
        kv = common_pb2.KVDescriptor(
            model_fingerprint=self.vllm.fingerprint, dtype=self.vllm.dtype, num_tokens=len(job.token_ids),
            token_ids_hash=hash_token_ids(job.token_ids),
        )  # fmt: skip
        job.emit(prefill_done=prefill_pb2.PrefillDone(first_token=first, kv=kv, prefill_s=prefill_s))
        outcome = None
        while outcome is None:  # in short slices: a Cancel or the deadline ends the wait
            self._check(job)
            outcome = self.vllm.wait_shipped(kv_params, min(1.0, max(0.01, job.deadline - time.monotonic())))
        if outcome["status"] != "completed":
            job.cancel(shipment_error(outcome))
            raise _Stop
        complete = prefill_pb2.ShipmentComplete(
            raw_bytes=outcome["raw_bytes"], wire_bytes=outcome["wire_bytes"], transfer_s=outcome["seconds"]
        )
        job.emit(shipment_complete=complete)

    @unary
    def Reship(self, request: prefill_pb2.ReshipRequest, context: Any) -> prefill_pb2.ReshipReply:
        raise NotFound("no KV lease: a vLLM prefill region frees a prompt's KV once it is shipped; prefill again")

    def close(self) -> None:
        super().close()
        self.vllm.close()
