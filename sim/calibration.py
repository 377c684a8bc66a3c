"""Calibration mode: the simulator driven by timings measured on a real deployment instead of
the roofline model, to predict what a `prfaas bench` run of a workload file will show.

Input 1, the timings (JSON, `version: 1`; written by bench/sim_calibrate.py; docs/simulator.md,
"Calibration"): the model's KV shape, each region's worker counts and fitted timings

    prefill_s(n new tokens after c cached) = base_s + per_token_s * n + per_token_ctx_s * n * (c + n / 2)
    decode_step_s(batch, context tokens)   = base_s + per_seq_s * batch + per_ctx_token_s * context

the links (goodput, RTT), the fixed per-request overhead outside the engines (`overhead_s`:
API, job store, dispatch, gRPC, streaming) and the deployment's disaggregation threshold.

Input 2, the workload: a JSONL trace (`sim.workload.load_trace`); rows that carry a measured
`ttft_s` (what `prfaas bench` records) are the figures the prediction is compared with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prfaas.control_plane.scheduling import Slo
from prfaas.sim.experiment import percentile
from prfaas.sim.fleet import FleetSpec, LinkSpec, RegionSpec
from prfaas.sim.hardware import ModelProfile
from prfaas.sim.policies import policy_with_threshold, prfaas_policy, split_by_length_policy
from prfaas.sim.simulator import Outcome, Simulation
from prfaas.sim.workload import Arrival, load_trace

_Pos = Field(ge=0, allow_inf_nan=False)


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PrefillFit(_Strict):
    base_s: float = _Pos
    per_token_s: float = _Pos
    per_token_ctx_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _takes_time(self) -> PrefillFit:
        # all zero: a prefill would take no time and its rate (tokens/s) divide by zero; a fit with the
        # quadratic term alone is a time still (fit_prefill drops the terms that come out negative)
        if self.base_s + self.per_token_s + self.per_token_ctx_s <= 0:
            raise ValueError("a prefill takes time: base_s, per_token_s or per_token_ctx_s must be > 0")
        return self


class DecodeFit(_Strict):
    base_s: float = _Pos
    per_seq_s: float = _Pos  # an engine that does not batch: the whole single-sequence step here
    per_ctx_token_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class RegionTimings(_Strict):
    name: str = Field(min_length=1)
    role: Literal["prefill", "both"]
    num_prefill_workers: int = Field(ge=0)
    num_decode_workers: int = Field(default=0, ge=0)
    usd_per_gpu_hour: float = Field(default=1.0, ge=0)
    kv_capacity_bytes: int = Field(default=2**30, ge=1)  # per decode worker
    prefill: PrefillFit
    decode: DecodeFit | None = None
    # "shared": the region's engine slots serve both its local prefills and its decodes, one
    # request per slot from its prefill (local) or hand-off (split) to its last token, as the
    # local decode region does; "separate": prefill and decode pools of their own (PD cluster)
    engine_slots: Literal["shared", "separate"] = "shared"

    @model_validator(mode="after")
    def _slots_match(self) -> RegionTimings:
        shared = self.role == "both" and self.engine_slots == "shared"
        if shared and self.num_prefill_workers != self.num_decode_workers:
            raise ValueError("shared engine slots: num_prefill_workers and num_decode_workers are the same slots")
        if self.decodes and self.decode is None:  # no figure would do: any stands in for a measurement
            raise ValueError("a region of role both with decode workers needs its decode fit")
        return self

    @property
    def decodes(self) -> bool:
        return self.role == "both" and self.num_decode_workers > 0


class LinkTimings(_Strict):
    src: str
    dst: str
    bandwidth_gbps: float = Field(gt=0)  # goodput measured on the path
    rtt_ms: float = _Pos


class ModelTimings(_Strict):
    name: str = Field(min_length=1)
    num_layers: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1)


class Timings(_Strict):
    version: Literal[1] = 1
    source: str = ""  # how and where they were measured
    model: ModelTimings
    regions: list[RegionTimings] = Field(min_length=1)
    links: list[LinkTimings] = Field(default_factory=list)
    overhead_s: float = _Pos
    min_uncached_tokens: int = Field(default=19_400, ge=0)
    # "length": split exactly the requests at or above the threshold (what a deployment whose
    # prefill region is much cheaper does); "policy": let the default policy's cost model decide
    route: Literal["length", "policy"] = "length"

    @model_validator(mode="after")
    def _one_decodes(self) -> Timings:
        if not any(region.decodes for region in self.regions):  # every request would be rejected
            raise ValueError("no region decodes: one needs role both and num_decode_workers >= 1")
        return self


def load_timings(path: str | Path) -> Timings:
    try:
        return Timings.model_validate(json.loads(Path(path).read_text(encoding="utf-8")))
    except OSError as exc:
        raise ValueError(f"cannot read timings {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"timings {path} are not JSON: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"timings {path}: {where + ': ' if where else ''}{first['msg']}") from None


@dataclass(frozen=True)
class MeasuredWorker:
    """A worker whose timings are the deployment's fitted measurements (`WorkerTimings`)."""

    prefill: PrefillFit
    decode: DecodeFit | None
    kv_capacity_bytes: int

    @property
    def max_batch(self) -> int | None:
        return None

    def prefill_s(self, num_tokens: int, cached_tokens: int = 0) -> float:
        f = self.prefill
        if num_tokens <= 0:
            return 0.0
        return f.base_s + f.per_token_s * num_tokens + f.per_token_ctx_s * num_tokens * (cached_tokens + num_tokens / 2)

    def prefill_tokens_per_s(self, num_tokens: int = 1024) -> float:
        return num_tokens / self.prefill_s(num_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        d = self.decode
        if d is None:
            return 1.0  # a prefill-only region never decodes; any positive figure will do
        return max(1e-6, d.base_s + d.per_seq_s * batch + d.per_ctx_token_s * context_tokens)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares intercept and slope, both clipped at 0 (a time cannot shrink with size)."""
    n = len(xs)
    if n == 0 or n != len(ys):
        raise ValueError("need as many x as y samples, at least one")
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def fit_prefill(lengths: Sequence[int], seconds: Sequence[float]) -> PrefillFit:
    """Least squares of seconds = base + per_token * n + per_token_ctx * n^2 / 2 (prompts with no
    cache hit); a term whose coefficient comes out negative is dropped and the rest refitted."""
    if len(lengths) != len(seconds) or len(lengths) < 3:
        raise ValueError("need at least three (length, seconds) samples")
    terms = [0, 1, 2]
    while True:
        columns = [[1.0, float(n), n * n / 2.0] for n in lengths]
        a = np.array([[row[t] for t in terms] for row in columns])
        coef, *_ = np.linalg.lstsq(a, np.array(seconds, dtype=float), rcond=None)
        negative = [t for t, c in zip(terms, coef, strict=True) if c < 0]
        if not negative or len(terms) == 1:
            values = dict.fromkeys((0, 1, 2), 0.0) | {t: max(0.0, float(c)) for t, c in zip(terms, coef, strict=True)}
            return PrefillFit(base_s=values[0], per_token_s=values[1], per_token_ctx_s=values[2])
        terms.remove(negative[0])


def fleet_of(timings: Timings) -> tuple[FleetSpec, dict[str, MeasuredWorker]]:
    m = timings.model
    # only the KV geometry matters here: the measured workers replace the roofline
    profile = ModelProfile(m.name, 1.0, 1.0, m.num_layers, m.kv_bytes_per_token, 0.0)
    regions = tuple(
        RegionSpec(
            r.name,
            "host-cpu",
            r.num_prefill_workers,
            r.num_decode_workers if r.role == "both" else 0,
            gpus_per_worker=1,
            usd_per_gpu_hour=r.usd_per_gpu_hour,
            shared_workers=r.role == "both" and r.engine_slots == "shared" and r.num_decode_workers > 0,
        )
        for r in timings.regions
    )
    links = tuple(LinkSpec(lk.src, lk.dst, lk.bandwidth_gbps, lk.rtt_ms, efficiency=1.0) for lk in timings.links)
    workers = {r.name: MeasuredWorker(r.prefill, r.decode, r.kv_capacity_bytes) for r in timings.regions}
    return FleetSpec(m.name, regions, links, profile=profile), workers


@dataclass(frozen=True)
class Prediction:
    """Predicted TTFT percentiles beside measured ones, both over the same requests: those that completed in the
    simulation and (when the trace has any) carry a measured `ttft_s` (`num_compared`)."""

    num_requests: int
    num_completed: int  # in the simulation
    num_rejected: int  # in the simulation (e.g. no worker's KV buffer holds the prompt)
    rejected: dict[str, int]  # reason -> requests
    num_split: int
    num_compared: int
    predicted_ttft_p50_s: float | None  # None: no request to compare
    predicted_ttft_p90_s: float | None
    measured_ttft_p50_s: float | None  # from the trace's `ttft_s` fields, when it has them
    measured_ttft_p90_s: float | None

    @property
    def error(self) -> float | None:
        """Predicted P50 / measured P50 - 1."""
        if not self.measured_ttft_p50_s or self.predicted_ttft_p50_s is None:
            return None
        return self.predicted_ttft_p50_s / self.measured_ttft_p50_s - 1

    def as_row(self) -> dict[str, Any]:
        """The `--json` document: strict JSON (a figure that is not finite is null, never `Infinity`)."""
        row = {**self.__dict__, "error": self.error}
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}

    def lines(self) -> list[str]:
        """What `prfaas sim calibrate` and bench/sim_calibrate.py print."""
        why = ", ".join(f"{reason}: {n}" for reason, n in self.rejected.items())
        out = [
            f"{self.num_requests} requests in the simulation: {self.num_completed} completed ({self.num_split} split), "
            f"{self.num_rejected} rejected" + (f" ({why})" if why else "")
        ]
        if self.measured_ttft_p50_s is not None and self.num_compared < self.num_requests:
            out.append(f"TTFT over the {self.num_compared} requests completed in the simulation and measured")
        for q, predicted, measured in ((50, self.predicted_ttft_p50_s, self.measured_ttft_p50_s),
                                       (90, self.predicted_ttft_p90_s, self.measured_ttft_p90_s)):  # fmt: skip
            line = f"TTFT P{q}: predicted {_ms(predicted)}, measured {_ms(measured)}"
            out.append(line + ("" if q != 50 or self.error is None else f", error {self.error:+.1%}"))
        return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def measured_ttfts(path: str | Path) -> list[float | None]:
    """Each trace row's measured `ttft_s` (None where it has none: not measured, or the request failed), in the
    order `load_trace` replays the rows (by `t_s`, ties in file order), so that the i-th is the i-th arrival's."""
    rows: list[tuple[float, float | None]] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            doc = json.loads(line)
            value = doc.get("ttft_s")
            finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            rows.append((float(doc["t_s"]), float(value) if finite else None))
    first = min((t for t, _ in rows), default=0.0)
    return [ttft for _, ttft in sorted(rows, key=lambda row: row[0] - first)]  # load_trace's key, stable too


def predict(timings: Timings, arrivals: Sequence[Arrival], measured: Sequence[float | None] = ()) -> Prediction:
    """Simulate `arrivals` on the measured deployment, routed as `timings.route` says at the
    deployment's threshold, with no SLO cut (a bench run sends everything). `measured`: none, or
    the measured TTFT (None: none) of each arrival, in order; predicted and measured percentiles
    are then over the requests that have both."""
    if measured and len(measured) != len(arrivals):
        raise ValueError(f"{len(measured)} measured TTFTs for {len(arrivals)} requests: one per request, in order")
    fleet, workers = fleet_of(timings)
    if timings.route == "length":
        policy = split_by_length_policy(timings.min_uncached_tokens)
    else:
        policy = policy_with_threshold(prfaas_policy(), timings.min_uncached_tokens)
    slo = Slo(ttft_ms=3_600_000, tpot_ms=60_000)
    sim = Simulation(fleet, policy.scheduler(), slo, workers=workers, dispatch_overhead_s=timings.overhead_s)
    records = sim.run(arrivals)
    done = [r for r in records if r.outcome is Outcome.COMPLETED]
    rejected: dict[str, int] = {}
    for r in records:
        if r.outcome is not Outcome.COMPLETED:
            rejected[str(r.reason)] = rejected.get(str(r.reason), 0) + 1
    has_measured = any(m is not None for m in measured)
    pairs = [(r.ttft_s, measured[r.index] if has_measured else None) for r in done]
    if has_measured:  # the same requests on both sides: those the simulation served and the run measured
        pairs = [(p, m) for p, m in pairs if m is not None]
    predicted = [p for p, _ in pairs]
    got = [m for _, m in pairs if m is not None]
    return Prediction(
        num_requests=len(records),
        num_completed=len(done),
        num_rejected=len(records) - len(done),
        rejected=rejected,
        num_split=sum(1 for r in done if r.mode == "split"),
        num_compared=len(pairs),
        predicted_ttft_p50_s=percentile(predicted, 50) if predicted else None,
        predicted_ttft_p90_s=percentile(predicted, 90) if predicted else None,
        measured_ttft_p50_s=percentile(got, 50) if got else None,
        measured_ttft_p90_s=percentile(got, 90) if got else None,
    )


def predict_trace(timings_path: str | Path, trace_path: str | Path) -> Prediction:
    return predict(load_timings(timings_path), load_trace(trace_path), measured_ttfts(trace_path))
