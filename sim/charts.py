"""PNG charts of `prfaas sim` results (matplotlib, Agg backend: no display needed).

matplotlib is imported here only, on first use, so the simulator itself runs without it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_PANELS = (
    ("throughput_at_slo_rps", "throughput at SLO (req/s)"),
    ("ttft_p90_at_common_rate_s", "P90 TTFT at one common rate (s)"),
    ("usd_per_mtok", "$ per 1M tokens"),
)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency of prfaas
        raise RuntimeError("PNG charts need matplotlib (pip install 'matplotlib>=3.9')") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def policy_chart(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, title: str = "") -> Path:
    """Grouped bars: one group per policy, one bar per run (label -> rows of `prfaas sim run --json`)."""
    plt = _pyplot()
    policies: list[str] = []
    for rows in runs.values():
        for row in rows:
            if row["policy"] not in policies:
                policies.append(row["policy"])
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(4.4 * len(_PANELS), 4.0))
    width = 0.8 / max(1, len(runs))
    for ax, (key, label) in zip(axes, _PANELS, strict=True):
        for i, (run, rows) in enumerate(runs.items()):
            by = {row["policy"]: row for row in rows}
            values = [(by[p].get(key) or 0.0) if p in by else 0.0 for p in policies]
            ax.bar([x + i * width for x in range(len(policies))], values, width, label=run)
        ticks = [x + width * (len(runs) - 1) / 2 for x in range(len(policies))]
        ax.set_xticks(ticks, policies, rotation=25, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
    if len(runs) > 1:
        axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    return _save(plt, fig, path)


def plan_chart(points: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Throughput at SLO against the threshold, one line per prefill:decode split."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    lines: dict[str, list[tuple[float, float]]] = {}
    for point in points:
        split = ", ".join(f"{n} {p}P:{point['decode_workers'][n]}D" for n, p in point["prefill_workers"].items())
        lines.setdefault(split, []).append((point["threshold"] or 0, point["throughput_at_slo_rps"]))
    for split, xy in lines.items():
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=split)
    ax.set_xlabel("disaggregation threshold (uncached tokens)")
    ax.set_ylabel("throughput at SLO (req/s)")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
