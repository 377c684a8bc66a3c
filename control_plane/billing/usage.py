"""From a finished job's record and timeline in the job store to what it is billed (pure; no I/O).

What is measured, per job (fields written into the job hash on the way, see `served_timing`):
- split: prefill GPU-s = the prefill region's `PrefillDone.prefill_s`; decode GPU-s = the decode stream's
  elapsed time from its first token to its last (`TokenEvent.elapsed_s`), less its region's stalls (gaps
  between two tokens over `STALL_GAP_S`, jobs/tokenlog.py: `gen_stall_s`).
- local: prefill GPU-s = `Generate`'s elapsed time to its first token; decode GPU-s as above.
- a wasted attempt: the wall time its region held the job, from the attempt's timeline (PREFILLING -> next
  entry in the prefill region; TRANSFERRING / DECODING -> next entry in the decode region; LOCAL -> next entry).
- a job its client canceled after tokens came (`billable`): as a DONE one, up to the last token its follower got
  (the `cut_` fields, `Outputs.cut`); its earlier attempts are wasted work, as a DONE job's are.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prfaas.control_plane.billing.costs import JobUsage

if TYPE_CHECKING:
    from prfaas.control_plane.jobs.tokenlog import StreamTiming


@dataclass(frozen=True)
class Work:
    """GPU time one attempt spent in one region without producing the answer."""

    attempt: int
    phase: str  # "prefill", "decode" or "local"
    region: str
    gpu_s: float
    reason: str


def served_timing(timing: StreamTiming | None, last_elapsed_s: float) -> dict[str, float]:
    """Job-hash fields the API records with DONE: the timing of the stream that brought the last token (None:
    its token 0 never came on it)."""
    return {"gen_last_s": last_elapsed_s} if timing is None else timing.served()


def billable(job: dict[str, str]) -> bool:
    """Whether the job is billed to its tenant: DONE, or CANCELED by its client (`client_canceled`: it left,
    or the tenant canceled the job) after tokens reached its follower (`cut_tokens`): the work up to the cut. A
    job canceled before its first token, or by the platform (its deadline, a batch's other prompt failing),
    is the platform's cost (`wasted_work`)."""
    if job.get("state") == "DONE":
        return True
    cut = job.get("state") == "CANCELED" and job.get("client_canceled") == "1" and int(job.get("cut_tokens") or 0) > 0
    # of its last attempt (a record from one that failed over before the cancel: that one is the platform's cost),
    # whose first token came before the cancel (one that came after it, to another process, is not the tenant's)
    first_at, canceled_at = _f(job, "cut_first_at"), _f(job, "canceled_at")
    before = first_at is None or canceled_at is None or first_at <= canceled_at
    return cut and before and job.get("cut_attempt", job.get("attempt")) == job.get("attempt")


def _f(job: dict[str, str], name: str) -> float | None:
    value = job.get(name)
    return None if value in (None, "") else float(value)  # type: ignore[arg-type]


def _attempt_regions(job: dict[str, str], timeline: list[dict[str, Any]], attempt: int) -> tuple[str, str]:
    """(prefill region, decode region) of `attempt`: dispatch's `regions_a{n}`, else the timeline's notes."""
    recorded = job.get(f"regions_a{attempt}")
    if recorded and ">" in recorded:
        p, d = recorded.split(">", 1)
        return p, d
    prefill = decode = job.get("decode_region", "")
    for e in timeline:
        note = str(e.get("note", ""))
        if e.get("attempt") == attempt and note.startswith("prefill in "):
            prefill = note.removeprefix("prefill in ").split("/")[0]
        if e.get("attempt") == attempt and note.startswith("local in "):  # "local in REGION/INSTANCE"
            prefill = decode = note.removeprefix("local in ").split("/")[0]
    return prefill or decode, decode


def _reshipped(timeline: list[dict[str, Any]]) -> tuple[set[int], dict[int, int]]:
    """(the attempts that reshipped a lease's KV rather than prefill, each of them -> the attempt whose prefill
    computed that KV: the last one before it that prefilled on the instance it reshipped from, "reship from
    REGION/INSTANCE" matching "prefill in REGION/INSTANCE" (a note of a region alone matches its region). A
    fresh prefill elsewhere between the two (the lease's instance looked dead to dispatch, then that prefill
    failed) is not the reshipped one."""
    prefills = sorted((int(e.get("attempt", 0)), str(e.get("note", ""))) for e in timeline
                      if e["state"] == "PREFILLING")  # fmt: skip
    reships = {a for a, note in prefills if note.startswith("reship from ")}
    origin: dict[int, int] = {}
    for b, note in prefills:
        if b not in reships:
            continue
        source = note.removeprefix("reship from ").strip()
        for a, earlier in reversed([p for p in prefills if p[0] < b and p[0] not in reships]):
            where = earlier.removeprefix("prefill in ").split(":")[0].strip()
            if where == source or ("/" not in where and where == source.split("/")[0]):
                origin[b] = a
                break
    return reships, origin


def wasted_work(job: dict[str, str], timeline: list[dict[str, Any]], attempts: range) -> list[Work]:
    """The GPU time each attempt in `attempts` held a region, from the timeline: wall time, so a region that
    hung holding the attempt counts until the attempt was taken back (the GPU was the job's, doing nothing
    else). A reship's "prefill" is no prefill (the KV was computed before: its shipping is not GPU work), and
    the prefill whose KV the answering attempt reshipped is not wasted (the tenant's bill has it, as
    `prefill_gpu_s`; before, it was counted in both)."""
    out: list[Work] = []
    entries = sorted(timeline, key=lambda e: float(e["at"]))
    reships, origin = _reshipped(timeline)
    final = max((int(e.get("attempt", 0)) for e in timeline), default=0)
    answered = origin.get(final) if final not in attempts else None  # the answer's prefill, reshipped
    for a in attempts:
        mine = [e for e in entries if e.get("attempt") == a]
        later = [e for e in entries if int(e.get("attempt", 0)) > a or e["state"] in ("FAILED", "CANCELED")]
        prefill, decode = _attempt_regions(job, timeline, a)
        for i, e in enumerate(mine):
            phase = {"PREFILLING": "prefill", "TRANSFERRING": "decode", "DECODING": "decode", "LOCAL": "local"}
            if e["state"] not in phase:
                continue
            if e["state"] == "PREFILLING" and (a in reships or a == answered):
                continue
            start = float(e["at"])
            ends = [float(x["at"]) for x in mine[i + 1 :] + later if float(x["at"]) >= start]
            end = min(ends) if ends else start
            reason = next((str(x.get("note", "")) for x in later if float(x["at"]) >= start), "")
            region = prefill if e["state"] == "PREFILLING" else decode
            out.append(Work(a, phase[e["state"]], region, max(0.0, end - start), reason))
    # one row per (attempt, phase): TRANSFERRING and DECODING of one attempt add up
    merged: dict[tuple[int, str], Work] = {}
    for w in out:
        prev = merged.get((w.attempt, w.phase))
        merged[(w.attempt, w.phase)] = w if prev is None else Work(w.attempt, w.phase, w.region, prev.gpu_s + w.gpu_s,
                                                                    prev.reason)  # fmt: skip
    return list(merged.values())


def job_usage(job: dict[str, str], timeline: list[dict[str, Any]]) -> JobUsage:
    """The bill of a `billable` job: the work of its final attempt (the one that answered, or was cut short by
    its client: its tokens and decode time up to the last token its follower got)."""
    attempt = int(job["attempt"])
    split = job.get("placement_chosen") == "split"
    decode_region = job.get("decode_region", "")
    prefill_region = job.get("prefill_region", decode_region) if split else decode_region
    cut = job.get("state") == "CANCELED"  # its fields: what the follower recorded when the stream ended (`cut_`)
    end, first_s, last_s, stall_s, tokens, first_at_s = (
        ("CANCELED", "cut_first_s", "cut_last_s", "cut_stall_s", "cut_tokens", "cut_first_at") if cut
        else ("DONE", "gen_first_s", "gen_last_s", "gen_stall_s", "completion_tokens", "first_token_at")
    )  # fmt: skip
    first, last = _f(job, first_s), _f(job, last_s)
    stalled = _f(job, stall_s) or 0.0  # its region stopped between two tokens (jobs/tokenlog.py): no GPU time
    mine = {e["state"]: float(e["at"]) for e in timeline if e.get("attempt") == attempt}
    streamed_s = max(0.0, last - first) if last is not None and first is not None else 0.0
    decode_s = max(0.0, streamed_s - stalled)
    if cut and end in mine and _f(job, first_at_s) is not None:  # no later than the cancel (a token in flight then)
        decode_s = min(decode_s, max(0.0, mine[end] - float(job[first_at_s])))
    if split:
        prefill_s = _f(job, "prefill_gpu_s")
        if prefill_s is None and "PREFILLING" in mine and "TRANSFERRING" in mine:
            prefill_s = mine["TRANSFERRING"] - mine["PREFILLING"]
    else:
        prefill_s = first
        if prefill_s is None and "LOCAL" in mine and end in mine:
            prefill_s = mine[end] - mine["LOCAL"]
    tokens_out = int(job.get(tokens, 0) or 0)
    first_at = _f(job, first_at_s)
    ttft = first_at - float(job["created_at"]) if first_at is not None else None
    tpot = streamed_s / (tokens_out - 1) if tokens_out > 1 and last is not None and first is not None else None
    return JobUsage(
        job_id=job["id"], tenant=job["tenant"], model=job.get("model", ""), prefill_region=prefill_region,
        decode_region=decode_region, prefill_gpu_s=max(0.0, prefill_s or 0.0), decode_gpu_s=decode_s,
        tokens_in=int(job.get("prompt_tokens", 0) or 0), tokens_out=tokens_out,
        kv_bytes_raw=int(job.get("bytes_raw", 0) or 0) if split else 0,
        kv_bytes_wire=int(job.get("bytes_wire", 0) or 0) if split else 0,
        finished_at=dt.datetime.fromtimestamp(mine.get(end, float(job["updated_at"])), dt.UTC),
        placement="split" if split else "local", attempts=attempt, ttft_s=ttft, tpot_s=tpot,
        codec=job.get("codec", "") if split else "",
    )  # fmt: skip
