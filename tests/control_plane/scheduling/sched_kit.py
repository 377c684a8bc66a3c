"""Builders for scheduler tests: a small named fleet whose figures the tests reason about.

The reference fleet (default policy; threshold 19,400 uncached tokens):

    dec-east  decode   8x H200, 1 worker, $6/GPU-h, local prefill 20k tok/s, decode 5k tok/s, TPOT 30 ms
    dec-west  decode   8x H200, 1 worker, $8/GPU-h (dearer), otherwise as dec-east
    pre-cheap prefill  8x H20,  $1.5/GPU-h, 15k tok/s; link to each decode region 40 ms, 100 Gbps
    pre-mid   prefill  8x H20,  $2.5/GPU-h, 15k tok/s; link to each decode region 20 ms, 100 Gbps
    links: 10% utilized, $0.01/GB egress

Model: 60 layers, 16 KiB of KV per token (a hybrid model; 40k tokens = 655 MB raw).
For the 40k-token cold request (SLO: TTFT 4 s, TPOT 50 ms, 200 new tokens):
    local on dec-east: prefill 40k / 20k = 2.0 s; $ = 2.0 s * 8 GPUs * $6 / 3600 = $0.0267
    split via pre-cheap: prefill 40k / 15k = 2.67 s, $0.0089; lossless (ratio 1.47, encoder
      16 Gbit/s = 2 GB/s) ships 655 MB in 0.33 s, hidden behind prefill but the last layer
      and half an RTT: TTFT ~2.69 s; egress 446 MB * $0.01 = $0.0045; ~40% cheaper than local
    split via pre-mid: prefill $0.0148, so pre-cheap wins on price.
"""

from __future__ import annotations

from typing import Any

from prfaas.control_plane.scheduling.request import Request, Slo
from prfaas.control_plane.scheduling.snapshot import ClusterSnapshot, Link, ModelShape, Region, Role

MODEL = ModelShape(name="hybrid-test", num_layers=60, kv_bytes_per_token=16_384)
GiB = 2**30


def region(name: str, role: Role | str = Role.DECODE, **overrides: Any) -> Region:
    fields: dict[str, Any] = {
        "name": name,
        "role": role,
        "gpu_type": "H200",
        "num_gpus": 8,
        "num_workers": 1,
        "usd_per_gpu_hour": 6.0,
        "kv_buffer_free_bytes": 200 * GiB,
        "prefill_tokens_per_s": 20_000.0,
        "decode_tokens_per_s": 5_000.0,
        "tpot_ms": 30.0,
        "mean_prefill_s": 1.0,
    }
    if Role(role) is Role.PREFILL:
        fields |= {"gpu_type": "H20", "usd_per_gpu_hour": 2.0, "prefill_tokens_per_s": 15_000.0, "tpot_ms": 60.0}
    fields |= overrides
    return Region(**fields)


def link(src: str, dst: str, **overrides: Any) -> Link:
    fields: dict[str, Any] = {
        "src": src,
        "dst": dst,
        "rtt_ms": 40.0,
        "bandwidth_gbps": 100.0,
        "utilization": 0.1,
        "egress_usd_per_gb": 0.01,
    }
    return Link(**(fields | overrides))


def fleet(
    *,
    regions: dict[str, dict[str, Any]] | None = None,
    links: dict[tuple[str, str], dict[str, Any]] | None = None,
    extra_regions: tuple[Region, ...] = (),
    extra_links: tuple[Link, ...] = (),
) -> ClusterSnapshot:
    """The reference fleet, with per-region / per-link field overrides."""
    tweaks = regions or {}
    link_tweaks = links or {}
    base = [
        region("dec-east", Role.DECODE, **tweaks.get("dec-east", {})),
        region("dec-west", Role.DECODE, **({"usd_per_gpu_hour": 8.0} | tweaks.get("dec-west", {}))),
        region("pre-cheap", Role.PREFILL, **({"usd_per_gpu_hour": 1.5} | tweaks.get("pre-cheap", {}))),
        region("pre-mid", Role.PREFILL, **({"usd_per_gpu_hour": 2.5} | tweaks.get("pre-mid", {}))),
    ]
    base_links = []
    for dst in ("dec-east", "dec-west"):
        base_links.append(link("pre-cheap", dst, **link_tweaks.get(("pre-cheap", dst), {})))
        base_links.append(link("pre-mid", dst, **({"rtt_ms": 20.0} | link_tweaks.get(("pre-mid", dst), {}))))
    return ClusterSnapshot(
        taken_at_s=1.7e9, model=MODEL, regions=(*base, *extra_regions), links=(*base_links, *extra_links)
    )


def request(prompt_tokens: int = 40_000, **overrides: Any) -> Request:
    fields: dict[str, Any] = {
        "request_id": "r1",
        "tenant": "acme",
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": 200,
        "slo": Slo(ttft_ms=4_000.0, tpot_ms=50.0),
    }
    return Request(**(fields | overrides))


def hashes(num_blocks: int, prefix: str = "sys") -> tuple[str, ...]:
    return tuple(f"{prefix}-{i}" for i in range(num_blocks))
