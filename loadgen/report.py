"""Figures of a `prfaas bench` run: percentiles, throughput, goodput at SLO, $ per 1M tokens,
the JSONL request trace (docs/operations.md, "Request trace"), the PNG chart and the ratios
between policies."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prfaas.loadgen.client import Outcome

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def _codecs(ok: list[Outcome]) -> dict[str, int]:
    """How many shipments (requests whose KV was shipped) used each codec."""
    counts: dict[str, int] = {}
    for o in ok:
        codec = (o.job.get("decision") or {}).get("codec")
        if codec and int(o.job.get("bytes_raw", 0) or 0):
            counts[str(codec)] = counts.get(str(codec), 0) + 1
    return counts


def summarize(outcomes: list[Outcome], wall_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """Latency percentiles (s), throughput, goodput: requests/s that met both SLOs (DistServe)."""
    ok = [o for o in outcomes if o.ok]
    tokens_in = sum(o.prompt_tokens for o in ok)
    tokens_out = sum(o.output_tokens for o in ok)
    good = [o for o in ok if o.ttft_s is not None and o.ttft_s <= slo_ttft_s and (o.tpot_s or 0.0) <= slo_tpot_s]
    placements: dict[str, int] = {}
    for o in ok:
        chosen = str(o.job.get("placement_chosen") or "unknown")
        placements[chosen] = placements.get(chosen, 0) + 1
    if ok and all(o.usage for o in ok):  # the ledger (metering) when it has every job
        priced, source = ok, "ledger: GET /v1/usage/jobs/{id}"
        cost = sum(float(o.usage["total_usd"]) for o in ok)
        colocated_cost = sum(float(o.usage["colocated_usd"]) for o in ok)
    else:
        priced, source = [o for o in ok if "cost_usd" in o.job], "job store: GET /v1/jobs/{id} cost_usd"
        cost = sum(float(o.job["cost_usd"]) for o in priced)
        colocated_cost = sum(float(o.job.get("colocated_cost_usd", 0.0)) for o in priced)
    priced_tokens = sum(o.prompt_tokens + o.output_tokens for o in priced)
    return {
        "requests": len(outcomes), "completed": len(ok), "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if o.error})[:5], "wall_s": wall_s,
        "ttft_s": _dist([o.ttft_s for o in ok if o.ttft_s is not None]),
        "tpot_s": _dist([t for o in ok if (t := o.tpot_s) is not None]),
        "itl_s": _dist([g for o in ok for g in o.itl_s]),
        "e2e_s": _dist([o.latency_s for o in ok if o.latency_s is not None]),
        "throughput": {"requests_per_s": len(ok) / wall_s if wall_s else 0.0,
                       "input_tokens_per_s": tokens_in / wall_s if wall_s else 0.0,
                       "output_tokens_per_s": tokens_out / wall_s if wall_s else 0.0},
        "goodput": {"slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s, "requests_in_slo": len(good),
                    "share_in_slo": len(good) / len(outcomes) if outcomes else 0.0,
                    "requests_per_s": len(good) / wall_s if wall_s else 0.0},
        "placements": placements,
        "cost": None if not priced or not priced_tokens else {
            "source": source, "usd": cost, "colocated_usd": colocated_cost,
            "usd_per_1m_tokens": cost / priced_tokens * 1e6,
            "colocated_usd_per_1m_tokens": colocated_cost / priced_tokens * 1e6,
        },
        "kv_bytes": {"raw": sum(int(o.job.get("bytes_raw", 0)) for o in ok),
                     "wire": sum(int(o.job.get("bytes_wire", 0)) for o in ok)},
        "codecs": _codecs(ok),
        # prompt tokens the regions computed for the answers (a prefix cache served the rest: cached_tokens)
        "prefill_tokens_computed": sum(o.prompt_tokens - int(o.job.get("cached_tokens", 0) or 0) for o in ok),
        "cached_tokens": sum(int(o.job.get("cached_tokens", 0) or 0) for o in ok),
    }  # fmt: skip


def identical(texts: dict[int, str], others: dict[int, str]) -> int:
    """Replies equal, to the character, to the same request's reply under another policy."""
    return sum(1 for index, text in texts.items() if others.get(index) == text)


def trace_rows(policy: str, outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """One JSON object per request; `t_s`, `prompt_tokens`, `output_tokens`, `cached_tokens` are
    what `prfaas sim run --trace` replays (sim/workload.py `load_trace`)."""
    rows = []
    for o in outcomes:
        j = o.job
        rows.append({
            "t_s": round(o.at_s if o.at_s else o.sent_s, 6), "prompt_tokens": o.prompt_tokens,
            "output_tokens": o.output_tokens if o.ok else o.max_tokens, "max_tokens": o.max_tokens,
            "cached_tokens": o.shared_prefix_tokens, "prefix_group": o.prefix_group, "class": o.klass,
            "policy": policy, "sent_s": round(o.sent_s, 6), "ttft_s": o.ttft_s, "tpot_s": o.tpot_s,
            "latency_s": o.latency_s, "ok": o.ok, "error": o.error, "job_id": o.job_id,
            "placement": j.get("placement_chosen"), "prefill_region": j.get("prefill_region"),
            "decode_region": j.get("decode_region"), "bytes_raw": j.get("bytes_raw"), "bytes_wire": j.get("bytes_wire"),
            "cost_usd": o.usage.get("total_usd", j.get("cost_usd")), "attempts": j.get("attempt"),
            "prefill_cached_tokens": j.get("cached_tokens"),
        })  # fmt: skip
    return rows


def write_trace(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _cost(s: dict[str, Any]) -> float | None:
    return s["cost"]["usd_per_1m_tokens"] if s["cost"] else None


Getter = Callable[[dict[str, Any]], float | None]
RATIO_KEYS: tuple[tuple[str, Getter, bool], ...] = (  # (label, getter, higher is better)
    ("TTFT P50", lambda s: s["ttft_s"]["p50"], False),
    ("TTFT P90", lambda s: s["ttft_s"]["p90"], False),
    ("TPOT P50", lambda s: s["tpot_s"]["p50"], False),
    ("E2E P90", lambda s: s["e2e_s"]["p90"], False),
    ("throughput tok/s", lambda s: s["throughput"]["output_tokens_per_s"], True),
    ("goodput req/s", lambda s: s["goodput"]["requests_per_s"], True),
    ("$ / 1M tokens", _cost, False),
)


def ratios(summaries: dict[str, dict[str, Any]], baseline: str) -> dict[str, dict[str, float | None]]:
    """Each policy's figure divided by the baseline policy's, per `RATIO_KEYS` label."""
    out: dict[str, dict[str, float | None]] = {}
    for policy, summary in summaries.items():
        row: dict[str, float | None] = {}
        for label, get, _ in RATIO_KEYS:
            base, value = get(summaries[baseline]), get(summary)
            row[label] = value / base if base and value is not None else None
        out[policy] = row
    return out


def plot(path: Path, summaries: dict[str, dict[str, Any]], title: str) -> None:
    """Bars per policy: TTFT / TPOT / E2E percentiles (ms), throughput and goodput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(summaries)
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, key, label in zip(axes[:3], ("ttft_s", "tpot_s", "e2e_s"), ("TTFT", "TPOT", "end-to-end"), strict=True):
        width = 0.8 / max(1, len(policies))
        for i, policy in enumerate(policies):
            values = [1e3 * (summaries[policy][key][f"p{q}"] or 0.0) for q in PERCENTILES]
            ax.bar([x + i * width for x in range(len(PERCENTILES))], values, width, label=policy)
        ax.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(PERCENTILES))])
        ax.set_xticklabels([f"P{q}" for q in PERCENTILES])
        ax.set_ylabel("ms")
        ax.set_title(label)
    axes[0].legend()
    good = [summaries[p]["goodput"]["requests_per_s"] for p in policies]
    done = [summaries[p]["throughput"]["requests_per_s"] for p in policies]
    axes[3].bar(policies, done, label="completed req/s", alpha=0.5)
    axes[3].bar(policies, good, label="in SLO req/s")
    axes[3].set_title("throughput / goodput")
    axes[3].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
