"""The cost and latency model: predicted TTFT, TPOT and dollars of a placement.

Calibrated by the snapshot: every rate is the region's own measurement from its heartbeats
(prefill and decode tokens/s per worker, TPOT at current load, mean prefill job time) or the
link's (goodput, RTT). Formulas, inputs and their limits: docs/scheduler.md, "Cost and latency
model". Pure arithmetic; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prfaas.control_plane.scheduling.request import Priority, Request
from prfaas.control_plane.scheduling.snapshot import Link, ModelShape, Region

_S_PER_HOUR = 3600.0
_BYTES_PER_GB = 1e9


@dataclass(frozen=True)
class CodecOption:
    """A KV codec the transport offers. `compression_ratio` is raw bytes / wire bytes (1.47 for
    `lossless` on bf16 KV, docs/benchmarks.md); `encode_bytes_per_s` is the raw bytes/s a prefill
    region can encode with it (None: never the bottleneck)."""

    name: str
    compression_ratio: float
    lossy: bool
    encode_bytes_per_s: float | None = None


@dataclass(frozen=True)
class TransferPlan:
    """How the KV crosses the link: codec, starting stream count, bytes and exposed time."""

    codec: str
    num_streams: int
    raw_bytes: int
    wire_bytes: int
    exposed_s: float  # transfer time left after prefill ends (layer-wise streaming hides the rest)


@dataclass(frozen=True)
class Estimate:
    """Predicted latency and cost of one placement (local when `transfer` is None)."""

    uncached_tokens: int  # tokens prefilled
    queue_wait_s: float
    prefill_s: float
    transfer: TransferPlan | None
    ttft_s: float
    tpot_s: float
    prefill_usd: float
    decode_usd: float
    egress_usd: float

    @property
    def total_usd(self) -> float:
        return self.prefill_usd + self.decode_usd + self.egress_usd


class CostModel:
    """Turns measurements into predictions. Constructible from plain values (tests, simulator).

    `codecs`: the codecs the transport offers; `stream_window_bytes`: the TCP window one stream
    reaches (the stream count covers the link's bandwidth-delay product); `prefill_on_spot`:
    split prefill is priced at a region's spot price when it has one (prefill is idempotent and
    retried elsewhere if a spot GPU is reclaimed); decode and local prefill are on-demand;
    `lossy_min_exposed_share`: a lossy codec the request consented to is used only where it pays,
    when the best lossless plan's exposed transfer is at least this share of its TTFT (or fits no
    budget): on a fast link the KV crosses bit for bit even with consent.
    """

    def __init__(
        self,
        codecs: Sequence[CodecOption],
        *,
        stream_window_bytes: int = 4 * 2**20,
        min_streams: int = 1,
        max_streams: int = 64,
        prefill_on_spot: bool = True,
        lossy_min_exposed_share: float = 0.2,
    ) -> None:
        if not codecs:
            raise ValueError("at least one codec is needed")
        if all(codec.lossy for codec in codecs):
            raise ValueError("at least one lossless codec is needed (requests may forbid lossy ones)")
        if not 1 <= min_streams <= max_streams:
            raise ValueError(f"need 1 <= min_streams ({min_streams}) <= max_streams ({max_streams})")
        if stream_window_bytes < 1:
            raise ValueError("stream_window_bytes must be positive")
        self.codecs = tuple(codecs)
        self.stream_window_bytes = stream_window_bytes
        self.min_streams = min_streams
        self.max_streams = max_streams
        self.prefill_on_spot = prefill_on_spot
        self.lossy_min_exposed_share = lossy_min_exposed_share

    @staticmethod
    def queue_wait_s(region: Region, priority: Priority) -> float:
        """Expected wait for a prefill worker. With an idle worker and nothing queued ahead, 0.
        Otherwise, when the region reports its work in tokens: the queued prompts and half of the
        running ones (on average half done) at the workers' measured rate; when it reports jobs
        only: the jobs ahead (queued, plus one for the worker to free), each taking the mean prefill
        time. `high` priority skips the queue (it waits only for a worker)."""
        ahead = 0 if priority is Priority.HIGH else region.queue_depth
        idle = region.num_workers - region.num_busy_workers
        if ahead < idle:
            return 0.0
        if region.queued_prefill_tokens is not None:
            queued = 0 if priority is Priority.HIGH else region.queued_prefill_tokens
            tokens = queued + region.running_prefill_tokens / 2
            return tokens / (region.num_workers * region.prefill_tokens_per_s)
        return (ahead - idle + 1) / region.num_workers * region.mean_prefill_s

    @staticmethod
    def _gpu_usd(seconds: float, region: Region, price_per_gpu_hour: float) -> float:
        return seconds * region.gpus_per_worker * price_per_gpu_hour / _S_PER_HOUR

    def decode_usd(self, request: Request, decode: Region) -> float:
        """The request's share of a decode worker: max_new_tokens / worker decode tokens/s GPU-seconds,
        at the worker's nominal (full-batch) rate when the region reports one: priced at the measured
        rate, a region whose batch fills would look cheaper the busier it is and draw all decode."""
        decode_gpu_s = request.max_new_tokens / (decode.decode_nominal_tokens_per_s or decode.decode_tokens_per_s)
        return self._gpu_usd(decode_gpu_s, decode, decode.usd_per_gpu_hour)

    def local(self, request: Request, decode: Region, uncached_decode: int) -> Estimate:
        """The decode region prefills the `uncached_decode` tokens itself, then decodes."""
        wait_s = self.queue_wait_s(decode, request.priority)
        prefill_s = uncached_decode / decode.prefill_tokens_per_s
        return Estimate(
            uncached_tokens=uncached_decode,
            queue_wait_s=wait_s,
            prefill_s=prefill_s,
            transfer=None,
            ttft_s=wait_s + prefill_s,
            tpot_s=decode.tpot_ms / 1000.0,
            prefill_usd=self._gpu_usd(prefill_s, decode, decode.usd_per_gpu_hour),
            decode_usd=self.decode_usd(request, decode),
            egress_usd=0.0,
        )

    def split(
        self,
        request: Request,
        model: ModelShape,
        prefill: Region,
        decode: Region,
        link: Link,
        uncached_prefill: int,
        uncached_decode: int,
    ) -> Estimate:
        """`prefill` computes its `uncached_prefill` tokens and ships the KV the decode region
        lacks (`uncached_decode` tokens' worth) over `link`, layer by layer."""
        wait_s = self.queue_wait_s(prefill, request.priority)
        prefill_s = uncached_prefill / prefill.prefill_tokens_per_s
        budget_s = request.slo.ttft_ms / 1000.0 - wait_s - prefill_s
        # shipped in the prefill's dtype, with the request's recurrent state (a hybrid model's; the prompt's whole)
        kv_bytes = uncached_decode * model.kv_bytes_at(prefill.kv_dtype) + model.kv_state_bytes
        plan = self.plan_transfer(request, model, link, kv_bytes, prefill_s, budget_s, wait_s + prefill_s)
        price = prefill.usd_per_gpu_hour
        if self.prefill_on_spot and prefill.spot_usd_per_gpu_hour is not None:
            price = prefill.spot_usd_per_gpu_hour
        return Estimate(
            uncached_tokens=uncached_prefill,
            queue_wait_s=wait_s,
            prefill_s=prefill_s,
            transfer=plan,
            ttft_s=wait_s + prefill_s + plan.exposed_s,
            tpot_s=decode.tpot_ms / 1000.0,
            prefill_usd=self._gpu_usd(prefill_s, prefill, price),
            decode_usd=self.decode_usd(request, decode),
            egress_usd=plan.wire_bytes / _BYTES_PER_GB * link.egress_usd_per_gb,
        )

    def plan_transfer(
        self, request: Request, model: ModelShape, link: Link, raw_bytes: int, prefill_s: float, budget_s: float,
        ttft_before_s: float | None = None,
    ) -> TransferPlan:  # fmt: skip
        """Choose the codec and the starting stream count for one shipment.

        Codec: of the allowed codecs whose exposed time fits `budget_s` (the TTFT objective
        left after queue wait and prefill), the one with the fewest wire bytes (egress is paid
        per byte); when none fits, the fastest. Ties: the other criterion, then the name.

        Streams: enough TCP windows to cover the free bandwidth-delay product, at most
        `max_streams`; a stream moves at most one window per round trip, so the shipment's wire
        rate is at most min(free bandwidth, streams * window / RTT) (the window bound binds only
        when the stream count is capped: on a long, fat path).

        Exposed time: layer i (of L) is ready at prefill_s * i / L; the link moves raw bytes at
        r = min(that wire rate * ratio, encode rate), first come first served. The last byte
        lands at max over i of (ready_i + bytes of layers i..L / r); that is linear in i, so
        the maximum is at i = 1 or i = L:
            exposed = max(B / (L r), B / r - prefill_s (L - 1) / L) + RTT / 2

        Lossy codecs (with consent) are candidates only where they pay: when the plan chosen among the
        lossless codecs alone fits no budget, or its exposed time is at least `lossy_min_exposed_share`
        of its TTFT (`ttft_before_s`, the queue wait and prefill before the transfer, plus it).
        """
        free = link.free_bytes_per_s
        one_way_s = link.rtt_ms / 2000.0
        layers = model.num_layers
        wanted = free * link.rtt_ms / 1000.0 / self.stream_window_bytes  # the path's bandwidth-delay product
        streams = self.max_streams if wanted >= self.max_streams else max(self.min_streams, math.ceil(wanted))
        wire_rate = free  # wire bytes/s: the free bandwidth, or what the streams' windows carry per round trip
        rtt_s = link.rtt_ms / 1000.0
        if rtt_s > 0:
            wire_rate = min(free, streams * self.stream_window_bytes / rtt_s)

        def choose(candidates: Sequence[CodecOption]) -> tuple[tuple[int, float, str] | None, tuple[float, int, str]]:
            fitting: tuple[int, float, str] | None = None
            fastest: tuple[float, int, str] | None = None
            for codec in candidates:
                rate = wire_rate * codec.compression_ratio
                if codec.encode_bytes_per_s is not None:
                    rate = min(rate, codec.encode_bytes_per_s)
                if raw_bytes == 0:
                    exposed = one_way_s
                elif rate <= 0:
                    exposed = math.inf
                else:
                    exposed = max(raw_bytes / (layers * rate), raw_bytes / rate - prefill_s * (layers - 1) / layers)
                    exposed += one_way_s
                wire = math.ceil(raw_bytes / codec.compression_ratio)
                if exposed <= budget_s and (fitting is None or (wire, exposed, codec.name) < fitting):
                    fitting = (wire, exposed, codec.name)
                if fastest is None or (exposed, wire, codec.name) < fastest:
                    fastest = (exposed, wire, codec.name)
            assert fastest is not None, "the constructor guarantees a lossless codec"
            return fitting, fastest

        lossless = [c for c in self.codecs if not c.lossy]
        fitting, fastest = choose(lossless)
        exposed = fitting[1] if fitting is not None else fastest[0]
        before = prefill_s if ttft_before_s is None else ttft_before_s
        slow = fitting is None or exposed >= self.lossy_min_exposed_share * (before + exposed)
        consented = [c for c in self.codecs if c.lossy and request.allow_lossy_codec
                     and request.lossy_codec in (None, c.name)]  # fmt: skip
        if slow and consented:
            fitting, fastest = choose([*lossless, *consented])
        if fitting is not None:
            wire_bytes, exposed_s, codec_name = fitting
        else:
            exposed_s, wire_bytes, codec_name = fastest
        return TransferPlan(codec_name, streams, raw_bytes, wire_bytes, exposed_s)
