"""`VLLMPrefill`: the prefill backend of a region with `engine: vllm`.

A job is one vLLM request for one token carrying `prfaas_ship` params: the prfaas connector
ships each layer's KV to the decode region as vLLM computes it, or, to a decode region on
the same machine, all of it right after the forward (`vllm.ship`; the wire format of the HF
backend's shipments, so either engine decodes it); the backend then waits for the
shipment's outcome. The shipment outlives vLLM's request (it is still on the wire after the first
token), so a job that ends first cancels it in the server (`_Shipment`: no shipment outlives its job).
vLLM frees the KV once it is shipped, so there is nothing to reship.
The job's sampling is vLLM's for step 0 (engine/vllm/sampling.py: one choice per job), with
the first token's logprobs and the prompt's when asked.

Prefix caching is vLLM's own: a job's request carries its cache salt, vLLM reuses the cached
blocks of its prompt (`cached_tokens` reports them), and the prompt's blocks are recorded in
the region's mirror of that cache (`ResidencyMirror`) for its heartbeats. The shipment always
carries the whole prompt's KV (`ship_from_token` is not honoured: a decode region takes that
as it is).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from prfaas.engine.base import ModelFacts
from prfaas.engine.errors import EngineError
from prfaas.engine.kv import hash_token_ids
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.vllm.params import ShipParams, layerwise_for
from prfaas.engine.vllm.remote import VLLMEngine, shipment_error
from prfaas.engine.vllm.sampling import check_supported, chosen, remember, salted, vllm_sampling
from prfaas.engine.vllm.server import StreamStopped
from prfaas.prefill_region.backend import JobProgress, JobStopped, PrefillWork, Reshipped, Shipped, kv_descriptor
from prfaas.prefill_region.destination import Destination
from prfaas.region.errors import InvalidRequest, NotFound
from prfaas.transport.identity import server_name
from prfaas.transport.pathmeter import PathReport

log = logging.getLogger(__name__)
CANCEL_TIMEOUT_S = 5.0  # a cancel_shipment call on the server (loopback, no compute)


class _Shipment:
    """One job's shipment from the vLLM server, canceled there once if the job ends before it does."""

    def __init__(self, vllm: VLLMEngine, kv_params: dict[str, Any]) -> None:
        self.vllm, self.kv_params = vllm, kv_params
        self._lock = threading.Lock()
        self._ended = False  # its outcome came: nothing to cancel
        self._canceling: threading.Thread | None = None

    def ended(self) -> None:
        with self._lock:
            self._ended = True

    def cancel_soon(self) -> None:
        """The job's cancel (`job.attach`): on a thread of its own, as whatever stopped the job (a Cancel, the
        caller leaving, the deadline) must not wait on the server."""
        with self._lock:
            if self._ended or self._canceling is not None:
                return
            self._canceling = threading.Thread(target=self._cancel, name="vllm-cancel-shipment", daemon=True)
            self._canceling.start()  # under the lock: `cancel` never joins a thread not started

    def cancel(self) -> None:
        """`run` leaving by an exception: canceled before it returns (bounded by CANCEL_TIMEOUT_S)."""
        self.cancel_soon()
        with self._lock:
            thread = self._canceling
        if thread is not None:
            thread.join(CANCEL_TIMEOUT_S + 1.0)

    def _cancel(self) -> None:
        try:
            self.vllm.cancel_shipment(self.kv_params, CANCEL_TIMEOUT_S)
        except EngineError as exc:  # a server gone took its transfers with it; a hung one's time out at the deadline
            log.warning("canceling the KV shipment of job %s failed: %s", self.kv_params["prfaas_ship"]["job_id"], exc)


class VLLMPrefill:
    """`ship`: "auto", "layerwise" or "after_forward" (region config `vllm.ship`)."""

    def __init__(self, engine: VLLMEngine, *, ship: str = "auto") -> None:
        layerwise_for("127.0.0.1", ship)  # a bad setting fails here, not on the first job
        self.vllm = engine
        self.facts: ModelFacts = engine.facts
        self.ship = ship

    def admit(self, destination: Destination, params: SamplingParams) -> Destination:
        check_supported(params)
        tcp = [e for e in destination.endpoints if e.kind == "tcp"]
        if not tcp:
            raise InvalidRequest(
                f"destination.kv_endpoint {destination.kv_endpoint!r} has no TCP endpoint: a vLLM prefill "
                "region ships KV over TCP only"
            )
        return dataclasses.replace(destination, address=tcp[0])

    def run(self, work: PrefillWork, job: JobProgress) -> Shipped:
        address = work.destination.address
        region = work.destination.decode_region
        ship = ShipParams(work.job_id, work.attempt, work.destination.ticket, str(address),
                          work.destination.codec, min(3600.0, work.deadline - time.monotonic()),
                          layerwise_for(address.host, self.ship),
                          server_name=server_name(region) if region else None)  # fmt: skip
        kv_params = ship.to_kv_params()
        shipment = _Shipment(self.vllm, kv_params)
        # before the request: a Cancel during the forward also stops a shipment the forward's last step opened
        job.attach(shipment.cancel_soon)
        try:
            return self._run(work, job, kv_params, shipment)
        except BaseException:
            shipment.cancel()  # however run ends early (a stop, an error of the server's): the shipment with it
            raise

    def _run(self, work: PrefillWork, job: JobProgress, kv_params: dict[str, Any], shipment: _Shipment) -> Shipped:
        t0 = time.monotonic()
        sampling = salted(vllm_sampling(work.params, "prefill"), work.cache_salt)
        try:  # a Cancel (or the region stopping) aborts the request in vLLM, not at the job's deadline
            result = self.vllm.generate_until(work.token_ids, 1, job.stop, kv_params=kv_params, sampling=sampling,
                                              timeout_s=max(0.1, work.deadline - t0))  # fmt: skip
        except StreamStopped:
            raise JobStopped from None  # job.error says why
        remember(self.vllm.prefix_cache, work.token_ids, work.cache_salt)
        prefill_s = time.monotonic() - t0
        job.check()
        kv = kv_descriptor(self.vllm.facts, len(work.token_ids), hash_token_ids(work.token_ids))
        logprobs = result["logprobs"]
        first = chosen((result["token_ids"][0], logprobs[0] if logprobs else None, result["prompt_logprobs"]))
        job.prefill_done([first], kv, prefill_s, int(result.get("num_cached_tokens") or 0))
        outcome = None
        while outcome is None:  # in short slices: a Cancel or the deadline ends the wait
            job.check()
            outcome = self.vllm.wait_shipped(kv_params, min(1.0, max(0.01, work.deadline - time.monotonic())))
        shipment.ended()
        if outcome["status"] != "completed":
            job.cancel(shipment_error(outcome))
            raise JobStopped
        return Shipped(raw_bytes=outcome["raw_bytes"], wire_bytes=outcome["wire_bytes"], seconds=outcome["seconds"])

    def reship(self, job_id: str, attempt: int, destination: Destination, deadline: float,
               on_cancel: Callable[[Callable[[], None]], object]) -> Reshipped:  # fmt: skip
        raise NotFound("no KV lease: a vLLM prefill region frees a prompt's KV once it is shipped; prefill again")

    def drop(self, job_id: str, attempt: int = 0) -> bool:
        return False

    def path_reports(self) -> list[tuple[str, PathReport]]:
        return []  # the KV leaves from inside vLLM (the connector's channels): not measured yet

    def close(self) -> None:
        self.vllm.close()
