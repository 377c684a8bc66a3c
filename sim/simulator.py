"""The discrete-event fleet simulation (simpy): arrivals, the live scheduler, prefill pools,
WAN links and decode pools.

Per request: build a `ClusterSnapshot` of the modelled fleet as it is now, ask the scheduler,
then run the decision. Prefill pools are FIFO `simpy.Resource`s of workers; a split's KV
crosses its link as a fluid flow sharing the link fairly with the other shipments in flight,
starting when its prefill starts (layer-wise streaming), never ahead of the layers the
prefill has produced (`sim.links`) nor faster than its codec encodes or its streams' TCP
windows carry per round trip (the scheduler's cost model's limits); decode is a continuous
batch per region advanced per batch iteration analytically (`sim.decode`): the KV is
reserved at placement and freed when the last token is out. Region and link snapshots are
rebuilt only when their state changed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import simpy
from pydantic import ValidationError

from prfaas.control_plane.scheduling import (
    ClusterSnapshot,
    Decision,
    GlobalScheduler,
    Mode,
    ModelShape,
    PlacementRejected,
    Request,
    Slo,
)
from prfaas.sim.decode import DecodeResult
from prfaas.sim.fleet import CODEC_RATIOS, FleetSpec, LinkSpec
from prfaas.sim.fleet_state import LinkState, RegionState
from prfaas.sim.hardware import WorkerTimings
from prfaas.sim.workload import Arrival

_EMA = 0.2  # weight of the newest prefill in the measured means a heartbeat would report


class Outcome(StrEnum):
    COMPLETED = "completed"
    REJECTED = "rejected"


@dataclass(frozen=True)
class RequestRecord:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    outcome: Outcome
    reason: str = ""  # the rejection reason
    mode: str = ""
    prefill_region: str = ""
    decode_region: str = ""
    ttft_s: float = math.inf
    tpot_s: float = math.inf
    finish_s: float = math.inf
    wire_bytes: int = 0
    kv_raw_bytes: int = 0  # the shipment's KV before the codec (0: not split)
    egress_usd: float = 0.0
    computed_tokens: int = 0  # prompt tokens prefilled (the rest came from a prefix cache)


class DoubleRecord(AssertionError):
    """A request was recorded twice (a simulator bug, never an input error)."""


class Simulation:
    """One run of `arrivals` on `fleet` under `scheduler`; `run()` returns one record per arrival."""

    def __init__(
        self,
        fleet: FleetSpec,
        scheduler: GlobalScheduler,
        slo: Slo,
        *,
        allow_lossy_codec: bool = False,
        workers: Mapping[str, WorkerTimings] | None = None,
        dispatch_overhead_s: float = 0.0,
        prefix_aware: bool = True,
    ) -> None:
        """`workers`: measured timings per region name instead of the roofline model (calibration);
        `dispatch_overhead_s`: fixed time from a request's arrival to its placement and from
        its first token to the tenant (API, job store, dispatch, streaming), added to TTFT.
        `prefix_aware`: arrivals that name their blocks are placed on what the regions' modelled
        prefix caches hold, and reuse it; False: as if there were no prefix caches (the bench's
        `prfaas-prefix-blind`)."""
        self.prefix_aware = prefix_aware
        self.fleet = fleet
        self.scheduler = scheduler
        self.slo = slo
        self.allow_lossy_codec = allow_lossy_codec
        self.env = simpy.Environment()
        model = fleet.model_profile
        self.model = model
        self.shape = ModelShape(
            name=model.name,
            num_layers=model.num_layers,
            kv_bytes_per_token=model.kv_bytes_per_token,
            kv_state_bytes=model.kv_state_bytes,
        )
        workers = workers or {}
        self.regions = {
            r.name: RegionState(self.env, r, workers[r.name] if r.name in workers else fleet.worker(r))
            for r in fleet.regions
        }
        self.dispatch_overhead_s = dispatch_overhead_s
        self.links = {(lk.src, lk.dst): LinkState(self.env, lk, model.num_layers) for lk in fleet.links}
        self.records: dict[int, RequestRecord] = {}
        self.decisions_s = 0.0

    def run(self, arrivals: Sequence[Arrival]) -> list[RequestRecord]:
        self.env.process(self._arrivals(arrivals))
        self.env.run()
        if len(self.records) != len(arrivals):
            raise AssertionError(f"{len(arrivals) - len(self.records)} requests never finished")
        return [self.records[i] for i in range(len(arrivals))]

    @property
    def now(self) -> float:
        return float(self.env.now)

    def _record(self, record: RequestRecord) -> None:
        if record.index in self.records:
            raise DoubleRecord(f"request {record.index} recorded twice")
        self.records[record.index] = record

    def _arrivals(self, arrivals: Sequence[Arrival]) -> Generator[simpy.Event, object, None]:
        for index, arrival in enumerate(arrivals):
            wait = arrival.at_s - self.now
            if wait > 0:
                yield self.env.timeout(wait)
            self.env.process(self._serve(index, arrival))

    def _snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(
            taken_at_s=self.now,
            model=self.shape,
            regions=tuple(s.snapshot_region() for s in self.regions.values()),
            links=tuple(s.snapshot_link() for s in self.links.values()),
        )

    def _request(self, index: int, arrival: Arrival) -> Request:
        if arrival.prefix or not self.prefix_aware:  # the live system's signal: block names against residency
            return Request(
                request_id=str(index), tenant="sim", prompt_tokens=arrival.prompt_tokens,
                max_new_tokens=arrival.output_tokens, slo=self.slo, allow_lossy_codec=self.allow_lossy_codec,
                prefix_block_hashes=arrival.prefix if self.prefix_aware else (),
                block_tokens=arrival.block_tokens or 16,
            )  # fmt: skip
        uncached = {
            name: arrival.prompt_tokens - (arrival.cached_tokens if state.spec.num_decode_workers else 0)
            for name, state in self.regions.items()
        }
        return Request(
            request_id=str(index),
            tenant="sim",
            prompt_tokens=arrival.prompt_tokens,
            max_new_tokens=arrival.output_tokens,
            slo=self.slo,
            uncached_tokens=uncached,
            allow_lossy_codec=self.allow_lossy_codec,
        )

    def _serve(self, index: int, arrival: Arrival) -> Generator[simpy.Event, object, None]:
        if self.dispatch_overhead_s > 0:
            yield self.env.timeout(self.dispatch_overhead_s)
        start = time.perf_counter()
        try:
            decision = self.scheduler.decide(self._snapshot(), self._request(index, arrival))
        except ValidationError as exc:
            # an input no snapshot or request can hold (an arrival of 0 tokens, ...): simpy re-raises a process's
            # exception as type(exc)(*exc.args), which a ValidationError cannot survive (a TypeError then)
            errors = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"request {index} (arrival at {arrival.at_s} s): bad {exc.title}: {errors}") from None
        except PlacementRejected as exc:
            self.decisions_s += time.perf_counter() - start
            self._record(
                RequestRecord(
                    index, arrival.at_s, arrival.prompt_tokens, arrival.output_tokens, Outcome.REJECTED, exc.reason
                )
            )
            return
        self.decisions_s += time.perf_counter() - start
        decode = self.regions[decision.decode_region]
        prefill = self.regions[decision.prefill_region]
        state = self.model.kv_state_bytes  # a hybrid model's recurrent states: per request, not per token
        kv_bytes = (arrival.prompt_tokens + arrival.output_tokens) * self.model.kv_bytes_per_token + state
        decode.kv_free -= kv_bytes  # the capacity filter saw at least this much free, at this instant
        assert prefill.prefill is not None, "the scheduler placed a prefill on a region without prefill workers"
        slot = prefill.prefill.request()
        prefill.queued_tokens += decision.uncached_tokens
        yield slot
        taken_s = self.now  # when this request's slot was taken (a shared one is held to the last token)
        prefill.queued_tokens -= decision.uncached_tokens
        prefill.running_tokens += decision.uncached_tokens
        cached = arrival.prompt_tokens - decision.uncached_tokens
        prefill_s = prefill.worker.prefill_s(decision.uncached_tokens, cached)
        shipment = None
        wire_bytes = raw_bytes = 0
        if decision.mode is Mode.SPLIT:
            link = self.links[(decision.prefill_region, decision.decode_region)]
            raw_bytes = decision.kv_bytes_raw  # the per-token KV and the recurrent state (the shape has both)
            ratio = CODEC_RATIOS.get(decision.codec or "raw")  # the transport's measured ratio, when we have it
            if ratio is None:
                ratio = decision.kv_bytes_raw / decision.kv_bytes_wire if decision.kv_bytes_wire else 1.0
            wire_bytes = math.ceil(raw_bytes / ratio)
            shipment = link.pipe.ship(wire_bytes, prefill_s, self._max_wire_rate(decision, link.spec, ratio))
        yield self.env.timeout(prefill_s)
        prefill.running_tokens -= decision.uncached_tokens
        if self.prefix_aware:
            prefill.prefix.keep(arrival.prefix)
        prefill.prefill_busy_s += prefill_s
        prefill.mean_prefill_s = _EMA * prefill_s + (1 - _EMA) * prefill.mean_prefill_s
        if decision.uncached_tokens and prefill_s > 0:
            prefill.prefill_tps = _EMA * decision.uncached_tokens / prefill_s + (1 - _EMA) * prefill.prefill_tps
        if shipment is not None or not decode.spec.shared_workers:
            prefill.prefill.release(slot)  # a shared local slot stays held through the decode
        if shipment is not None:
            yield shipment
            yield self.env.timeout(link.spec.rtt_ms / 2000.0)  # the last byte's propagation
            if decode.spec.shared_workers:
                assert decode.prefill is not None
                slot = decode.prefill.request()  # the hand-off waits for one of the decode region's slots
                yield slot
                taken_s = self.now
        result = yield decode.decode.decode(arrival.prompt_tokens, arrival.output_tokens)
        assert isinstance(result, DecodeResult)
        if self.prefix_aware:
            decode.prefix.keep(arrival.kept or arrival.prefix)
        if decode.spec.shared_workers:
            assert decode.prefill is not None
            decode.prefill.release(slot)
            decode.slot_released(self.now - taken_s)
        decode.kv_free += kv_bytes
        egress = wire_bytes / 1e9 * self._egress(decision.prefill_region, decision.decode_region)
        self._record(
            RequestRecord(
                index,
                arrival.at_s,
                arrival.prompt_tokens,
                arrival.output_tokens,
                Outcome.COMPLETED,
                mode=str(decision.mode),
                prefill_region=decision.prefill_region,
                decode_region=decision.decode_region,
                ttft_s=result.first_token_s - arrival.at_s,
                tpot_s=result.tpot_s,
                finish_s=result.finish_s,
                wire_bytes=wire_bytes,
                kv_raw_bytes=raw_bytes,
                egress_usd=egress,
                computed_tokens=decision.uncached_tokens,
            )
        )

    def _max_wire_rate(self, decision: Decision, link: LinkSpec, ratio: float) -> float:
        """The fastest a shipment leaves, in wire bytes/s, whatever its share of the link: the codec's encode
        rate (raw bytes/s, in wire bytes at the codec's ratio) and one TCP window per stream per round trip,
        the limits the scheduler's cost model applies to the same transfer (inf: neither is known)."""
        cost_model = self.scheduler.cost_model
        limit = math.inf
        for codec in cost_model.codecs:
            if codec.name == decision.codec and codec.encode_bytes_per_s is not None:
                limit = codec.encode_bytes_per_s / ratio
        rtt_s = link.rtt_ms / 1000.0
        if rtt_s > 0 and decision.num_streams > 0:
            limit = min(limit, decision.num_streams * cost_model.stream_window_bytes / rtt_s)
        return limit

    def _egress(self, src: str, dst: str) -> float:
        link = self.links.get((src, dst))
        return 0.0 if link is None else link.spec.egress_usd_per_gb
