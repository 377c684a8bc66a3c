"""`prfaas tour` (`make demo`): the first run's story, told against the deployment `prfaas up` started.

Three parts, each a real run: one chat completion sent split (prefill in a cheap region, the KV
shipped, decode in the scarce one) and local, with what each job's record says
(`completion_pair`); the same workload under three placement policies (`prfaas bench`, the
caller's); and the fleet the simulator models with the same scheduler (`fleet_command`, run by the
caller: devstack does not import the simulator), because a single host cannot show what a fleet
gains. Presentation is the caller's (cli/tour.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

PROMPT = (
    "Large language model serving has two phases. Prefill reads the whole prompt at once and is "
    "limited by compute; decode produces one token at a time and is limited by memory bandwidth. "
    "Explain in two sentences why a provider would run the two phases in different data centres."
)
SCENARIO = "prfaas-case-study"  # the fleet view's: the PrfaaS paper's case study (docs/simulator.md)
# The policies of the fleet view: prfaas beside the two disaggregated baselines it is measured against.
FLEET_POLICIES = ("prfaas", "homogeneous-pd", "naive-heterogeneous")
WHY_THEY_DIFFER = (
    "Why the two tables differ: on this host the three regions share 2 CPU cores and the 'WAN' is loopback, so "
    "the $ column is the topology's price book applied to what each region ran, and the latencies say how 2 cores "
    "are shared, not what a split gains. A fleet has what one host lacks: prefill on cheap compute-dense GPUs "
    "elsewhere, decode GPUs no longer stalled behind long prompts, a real link whose bytes the codec saves; that "
    "is where the fleet's throughput at SLO and P90 TTFT come from."
)


@dataclass(frozen=True)
class Completion:
    """One chat completion and what its job's record says about the path it took."""

    placement: str  # asked: split | local
    text: str
    seconds: float
    job: dict[str, Any]  # GET /v1/jobs/{id}

    @property
    def path(self) -> str:
        prefill, decode = self.job.get("prefill_region"), self.job.get("decode_region")
        return f"{prefill} -> {decode}" if prefill != decode else f"{decode} (one region)"

    @property
    def kv_bytes(self) -> tuple[int, int]:
        """KV bytes (raw, on the wire) the job shipped; (0, 0) when it stayed in one region."""
        return int(self.job.get("bytes_raw") or 0), int(self.job.get("bytes_wire") or 0)

    @property
    def codec(self) -> str | None:
        return (self.job.get("decision") or {}).get("codec")


class TourError(RuntimeError):
    """A part of the tour could not run (the deployment did not answer, a request failed)."""


def completion_pair(
    api_base: str, api_key: str, model: str, prompt: str = PROMPT, max_tokens: int = 48, timeout_s: float = 120.0
) -> tuple[Completion, Completion]:
    """The same chat completion (greedy) asked split, then local, through the official client."""
    import openai

    client = openai.OpenAI(base_url=api_base, api_key=api_key, max_retries=0, timeout=timeout_s)
    done = []
    for placement in ("split", "local"):
        start = time.perf_counter()
        try:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], temperature=0.0, max_tokens=max_tokens,
                extra_body={"prfaas": {"placement": placement}},
            )  # fmt: skip
            seconds = time.perf_counter() - start
            job = httpx.get(f"{api_base}/jobs/{reply.id}", headers={"Authorization": f"Bearer {api_key}"},
                            timeout=10).raise_for_status().json()  # fmt: skip
        except (openai.OpenAIError, httpx.HTTPError) as exc:
            raise TourError(f"the {placement} completion failed: {type(exc).__name__}: {exc}") from None
        done.append(Completion(placement, reply.choices[0].message.content or "", seconds, job))
    return done[0], done[1]


def fleet_command(scenario: str, num_requests: int | None) -> str:
    """The `prfaas sim run` command line of the fleet view (cli/tour.py runs the same comparison)."""
    policies = " ".join(f"--policy {name}" for name in FLEET_POLICIES)
    return (
        f"prfaas sim run --scenario {scenario}"
        + (f" --requests {num_requests}" if num_requests else "")
        + (f" {policies}")
    )


def fleet_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The closing table: each policy's throughput at SLO and P90 TTFT (at the rate every policy
    sustains), with prfaas's ratio to it."""
    ours = next(row for row in rows if row["policy"] == "prfaas")
    table = []
    for row in rows:
        rps, p90 = row["throughput_at_slo_rps"], row.get("ttft_p90_at_common_rate_s")
        ours_p90 = ours.get("ttft_p90_at_common_rate_s")
        table.append({
            "policy": row["policy"], "gpus": row.get("num_gpus"), "usd_per_hour": row.get("usd_per_hour"),
            "throughput_at_slo_rps": rps, "ttft_p90_s": p90, "usd_per_mtok": row.get("usd_per_mtok"),
            "prfaas_throughput_x": ours["throughput_at_slo_rps"] / rps if rps else None,
            "prfaas_ttft_p90_x": ours_p90 / p90 if ours_p90 and p90 else None,
        })  # fmt: skip
    return table
