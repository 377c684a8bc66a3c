"""A decode region that stalls mid-stream (SIGSTOP, then SIGCONT: a host paused, a process preempted) is not
paid for its stall (docs/metering.md, decode GPU-s), on metering_kit's stack: the job finishes, and its decode
GPU-s are the stream's time from first token to last less its stalls (each gap between two tokens over
`STALL_GAP_S`, less one step of the stream). Before, the tenant paid the whole stop at the decode region's
price, and later its first second."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import httpx
import pytest
from metering_kit import PRICES, Metered

from prfaas.control_plane.billing.models import UsageEntry
from prfaas.devstack.stack import wait_until

pytestmark = pytest.mark.e2e
STOP_S = 3.0  # well under the API's keepalive (a region hung longer breaks the stream: failover)


def _stopped_mid_stream(m: Metered, key: str, prompt: list[int], meanwhile: Callable[[str], None]) -> str:
    """A long local stream, read to its end, whose decode region (decode-b) stops for STOP_S at its third chunk;
    `meanwhile(job id)` runs 1 s into the stop. -> the job's id."""
    decode = next(r for r in m.stack.regions if r.name == "decode-b")
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 600, "ignore_eos": True, "stream": True,
            "prfaas": {"placement": "local"}}  # fmt: skip
    chunks = 0
    with httpx.stream("POST", m.stack.url + "/v1/completions", json=body, headers=_auth(key), timeout=60) as reply:
        job_id = reply.headers["X-Prfaas-Job-Id"]
        for line in reply.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                chunks += 1
                if chunks == 3:  # mid-answer
                    os.kill(decode.proc.pid, signal.SIGSTOP)
                    try:
                        time.sleep(1.0)
                        meanwhile(job_id)
                        time.sleep(STOP_S - 1.0)
                    finally:
                        os.kill(decode.proc.pid, signal.SIGCONT)
    wait_until(lambda: "decode-b" in m.stack.healthy(), 30, 0.1)  # beating again, for the tests after
    return job_id


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _entry(m: Metered, job_id: str) -> UsageEntry:
    ledger = m.ledger()
    try:
        wait_until(lambda: ledger.entry(job_id) is not None, 20, 0.1)
        entry = ledger.entry(job_id)
    finally:
        ledger.close()
    assert entry is not None
    return entry


def test_a_decode_region_stalled_mid_stream_is_not_billed_for_the_stall(metered: Metered) -> None:
    m = metered
    _, key = m.stack.tenant("stalled", allow_placement=True)
    job_id = _stopped_mid_stream(m, key, [5, 6, 7, 8, 9, 10], lambda _: None)
    job = httpx.get(f"{m.stack.url}/v1/jobs/{job_id}", headers=_auth(key), timeout=5).json()
    entry = _entry(m, job_id)
    assert job["state"] == "DONE" and entry.tokens_out == 600, job
    streamed_s = entry.tpot_s * (entry.tokens_out - 1)  # type: ignore[operator]  # first token to last, wall
    print(f"decode GPU-s billed {entry.decode_gpu_s:.3f} of a {streamed_s:.3f} s stream with a {STOP_S} s stop")
    assert streamed_s > STOP_S  # the stop is in the stream's time (its TPOT, what the client saw) ...
    assert entry.decode_gpu_s < streamed_s - STOP_S + 0.5  # ... not in what is billed (one step of it)
    assert entry.decode_usd == pytest.approx(entry.decode_gpu_s / 3600 * PRICES["decode-b"]["usd_per_gpu_hour"])


def test_a_job_canceled_while_its_decode_region_is_stopped_is_billed_up_to_the_cancel(metered: Metered) -> None:
    """The tenant cancels (DELETE) 1 s into a 3 s stop of the decode region, then the region resumes: what is
    billed is what the job had at the cancel, which the DELETE's answer shows. Before, the follower recorded the
    token the region sent on resuming (after the cancel), and with it the stall's first second: ~1 s of decode for
    a few ms of tokens, and more tokens than the DELETE reported."""
    m = metered
    _, key = m.stack.tenant("stalled-cancel", allow_placement=True)
    answers: list[httpx.Response] = []

    def cancel(job_id: str) -> None:
        answers.append(httpx.delete(f"{m.stack.url}/v1/jobs/{job_id}", headers=_auth(key), timeout=10))

    job_id = _stopped_mid_stream(m, key, [5, 6, 7, 8, 9, 11], cancel)
    (canceled,) = answers
    assert canceled.status_code == 200 and canceled.json()["state"] == "CANCELED", canceled.text
    entry, shown = _entry(m, job_id), canceled.json()["usage"]["completion_tokens"]
    assert entry.tokens_out == shown >= 3, (entry.tokens_out, shown)
    assert entry.decode_gpu_s < 0.5, entry.decode_gpu_s  # its tokens before the stop: not the stop
