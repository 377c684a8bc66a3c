"""The pure parts of metering (control_plane/billing/usage.py): a job record and its timeline -> the bill of the
attempt that answered and the wasted work of the others. Table-driven, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.control_plane.billing.usage import Work, billable, job_usage, served_timing, wasted_work
from prfaas.control_plane.jobs.tokenlog import STALL_GAP_S, Outputs, StreamTiming

T = 1_800_000_000.0  # epoch s


def _tl(*entries: tuple[str, int, float, str]) -> list[dict[str, Any]]:
    return [{"state": s, "attempt": a, "at": T + at, "note": note} for s, a, at, note in entries]


SPLIT = {
    "id": "j1", "tenant": "t", "model": "tiny-llama", "attempt": "1", "placement_chosen": "split",
    "prefill_region": "p", "decode_region": "d", "prefill_gpu_s": "0.8", "gen_first_s": "1.5", "gen_last_s": "2.1",
    "first_token_at": str(T + 1.6), "created_at": str(T), "updated_at": str(T + 2.2), "prompt_tokens": "600",
    "completion_tokens": "7", "bytes_raw": "1000", "bytes_wire": "600", "regions_a1": "p>d",
}  # fmt: skip
SPLIT_TL = _tl(("QUEUED", 1, 0, "created"), ("PREFILLING", 1, 0.1, "prefill in p"), ("TRANSFERRING", 1, 0.9, ""),
               ("DECODING", 1, 1.6, "first token"), ("DONE", 1, 2.2, "length"))  # fmt: skip


def test_split_job_bills_prefill_s_and_decode_stream_time() -> None:
    u = job_usage(SPLIT, SPLIT_TL)
    assert (u.prefill_region, u.decode_region, u.placement, u.attempts) == ("p", "d", "split", 1)
    assert u.prefill_gpu_s == 0.8  # the prefill region's PrefillDone.prefill_s
    assert u.decode_gpu_s == pytest.approx(0.6)  # last - first token of the decode stream
    assert (u.kv_bytes_raw, u.kv_bytes_wire, u.tokens_in, u.tokens_out) == (1000, 600, 600, 7)
    assert u.ttft_s == pytest.approx(1.6) and u.tpot_s == pytest.approx(0.1)  # 0.6 s over 6 tokens after the first
    assert u.finished_at is not None and u.finished_at.timestamp() == pytest.approx(T + 2.2)


def test_local_job_after_a_lost_prefill_region() -> None:
    """Attempt 1 split, its prefill region died 2 s into the prefill; attempt 2 ran locally in d."""
    job = SPLIT | {
        "attempt": "2", "placement_chosen": "local", "gen_first_s": "0.3", "gen_last_s": "0.5",
        "first_token_at": str(T + 3.0), "regions_a2": "d>d", "completion_tokens": "3",
    }  # fmt: skip
    tl = _tl(("QUEUED", 1, 0, "created"), ("PREFILLING", 1, 0.2, "prefill in p"),
             ("QUEUED", 2, 2.2, "prefill in p: UNAVAILABLE"), ("LOCAL", 2, 2.5, "local in d"),
             ("DONE", 2, 3.2, "length"))  # fmt: skip
    u = job_usage(job, tl)
    # billed: the local run only; the stale prefill_gpu_s and wire bytes of attempt 1 are not the tenant's
    assert (u.prefill_region, u.decode_region, u.placement, u.attempts) == ("d", "d", "local", 2)
    assert (u.prefill_gpu_s, u.kv_bytes_wire) == (0.3, 0)
    assert u.decode_gpu_s == pytest.approx(0.2)
    waste = wasted_work(job, tl, range(1, 2))
    assert waste == [Work(1, "prefill", "p", pytest.approx(2.0), "prefill in p: UNAVAILABLE")]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("timeline", "expected"),
    [
        # decode region lost after the KV arrived: prefill (0.8 s in p) and decode (1.0 s in d) both wasted
        (_tl(("PREFILLING", 1, 0, ""), ("TRANSFERRING", 1, 0.8, ""), ("DECODING", 1, 1.0, ""),
             ("QUEUED", 2, 1.8, "decode lost")),
         {(1, "prefill", "p"): 0.8, (1, "decode", "d"): 1.0}),
        # canceled while the local run went on: the whole local run is wasted
        (_tl(("LOCAL", 1, 0, "local in d"), ("CANCELED", 1, 0.5, "client disconnected")), {(1, "local", "d"): 0.5}),
        # queued and never placed: nothing was used
        (_tl(("QUEUED", 1, 0, "created"), ("FAILED", 1, 0.1, "no placement")), {}),
    ],
)  # fmt: skip
def test_wasted_work_from_the_timeline(
    timeline: list[dict[str, Any]], expected: dict[tuple[int, str, str], float]
) -> None:
    work = wasted_work(SPLIT, timeline, range(1, 2))
    assert {(w.attempt, w.phase, w.region): w.gpu_s for w in work} == pytest.approx(expected)


# attempt 1 prefilled in p (0.8 s) and lost its decode instance 1 s into decoding; attempt 2 reshipped the leased
# KV from p (0.3 s of shipping) to another decode instance, which answered
RESHIPPED_TL = _tl(
    ("PREFILLING", 1, 0, "prefill in p"), ("TRANSFERRING", 1, 0.8, ""), ("DECODING", 1, 1.0, ""),
    ("QUEUED", 2, 2.0, "decode lost"), ("PREFILLING", 2, 2.1, "reship from p/0"),
    ("TRANSFERRING", 2, 2.4, "reshipped"), ("DECODING", 2, 2.6, ""), ("DONE", 2, 3.0, "length"),
)  # fmt: skip


def test_a_prefill_the_answer_reshipped_is_billed_not_wasted() -> None:
    """The tenant's bill has attempt 1's prefill (`prefill_gpu_s`, kept by the reship); the waste is attempt 1's
    decode alone. Before, the prefill was in both, and the reship's shipping counted as a second prefill."""
    job = SPLIT | {"attempt": "2", "regions_a2": "p>d"}
    assert job_usage(job, RESHIPPED_TL).prefill_gpu_s == 0.8
    waste = wasted_work(job, RESHIPPED_TL, range(1, 2))
    assert [(w.attempt, w.phase, w.gpu_s) for w in waste] == [(1, "decode", pytest.approx(1.2))]


def test_a_reship_is_credited_to_the_prefill_on_the_instance_it_reshipped_from() -> None:
    """Attempt 1 prefilled on p/0 and lost its decode; attempt 2 prefilled afresh on q/0 (dispatch saw p/0's lease
    as dead a moment) and q died; attempt 3 reshipped p/0's KV after all and answered. The bill has attempt 1's
    prefill (its `prefill_gpu_s`): attempt 2's prefill in q is the waste, not attempt 1's (the last prefill before
    the reship, which the first version credited)."""
    tl = _tl(
        ("PREFILLING", 1, 0, "prefill in p/0"), ("TRANSFERRING", 1, 1.0, ""), ("DECODING", 1, 1.2, ""),
        ("QUEUED", 2, 2.0, "decode lost"), ("PREFILLING", 2, 2.1, "prefill in q/0"),
        ("QUEUED", 3, 4.1, "prefill in q/0: UNAVAILABLE"), ("PREFILLING", 3, 4.2, "reship from p/0"),
        ("TRANSFERRING", 3, 4.4, "reshipped"), ("DECODING", 3, 4.6, ""), ("DONE", 3, 5.0, "length"),
    )  # fmt: skip
    job = SPLIT | {"attempt": "3", "regions_a1": "p>d", "regions_a2": "q>d", "regions_a3": "p>d"}
    waste = wasted_work(job, tl, range(1, 3))
    assert {(w.attempt, w.phase, w.region): w.gpu_s for w in waste} == pytest.approx(
        {(1, "decode", "d"): 1.0, (2, "prefill", "q"): 2.0}
    )


def test_a_reshipped_job_that_failed_wastes_its_prefill_once() -> None:
    """No attempt answered: attempt 1's prefill is the platform's cost, once; attempt 2's reship is no prefill."""
    tl = RESHIPPED_TL[:-1] + _tl(("FAILED", 2, 3.0, "decode lost again"))
    waste = wasted_work(SPLIT | {"attempt": "2", "regions_a2": "p>d"}, tl, range(1, 3))
    assert {(w.attempt, w.phase): w.gpu_s for w in waste} == pytest.approx(
        {(1, "prefill"): 0.8, (1, "decode"): 1.2, (2, "decode"): 0.6}
    )


def test_attempt_regions_fall_back_to_timeline_notes() -> None:
    job = {k: v for k, v in SPLIT.items() if k != "regions_a1"}
    tl = _tl(("PREFILLING", 1, 0, "prefill in far-p"), ("QUEUED", 2, 1.0, "lost"))
    assert wasted_work(job, tl, range(1, 2)) == [Work(1, "prefill", "far-p", 1.0, "lost")]


def test_served_timing_without_a_first_token() -> None:
    assert served_timing(None, 2.0) == {"gen_last_s": 2.0}
    timing = StreamTiming(1, T, 0.5, 2.0, 0.25)
    assert served_timing(timing, 2.0) == {"first_token_at": T, "gen_first_s": 0.5, "gen_last_s": 2.0,
                                          "gen_stall_s": 0.25}  # fmt: skip


def test_a_stream_s_gaps_over_the_stall_gap_are_its_region_stalling() -> None:
    """Tokens at 0.1, 0.2, 0.4, 5.4 (a 5 s stop), 5.5 s: 4.85 s of stall (the gap less one of the stream's steps,
    their mean: 0.15 s; before, less STALL_GAP_S, so each stall billed a second); a stall before any step is one
    whole; a new stream (the next attempt) starts from none."""
    output = Outputs(())
    for elapsed in (0.1, 0.2, 0.4, 5.4, 5.5):
        timing = output.timed(1, (T, 0.1), elapsed)
    assert (timing.first_s, timing.last_s, timing.stall_s) == (0.1, 5.5, pytest.approx(5.0 - 0.15))
    assert STALL_GAP_S < 5.0
    assert output.timed(2, (T + 9, 0.3), 0.4).stall_s == 0.0
    assert output.timed(2, (T + 9, 0.3), 2.4).stall_s == 0.0  # no step yet: a step


@pytest.mark.parametrize("choices", [1, 2])
def test_a_slow_regions_steps_are_not_stalls(choices: int) -> None:
    """A region whose decode steps take 1.5 s (a big model on a CPU, a large batch), its n choices' tokens of a
    step coming together: every step is billed (a rule of gaps over 1 s alone billed none of them)."""
    output = Outputs(())
    for step in range(6):
        for choice in range(choices):
            timing = output.timed(1, (T, 0.0), step * 1.5 + choice * 0.001, choice)
    assert timing.stall_s == 0.0 and timing.last_s == pytest.approx(7.5 + (choices - 1) * 0.001)


def test_a_stall_is_not_billed_but_stays_in_the_tpot() -> None:
    job = SPLIT | {"gen_first_s": "1.5", "gen_last_s": "5.1", "gen_stall_s": "3.0"}
    usage = job_usage(job, SPLIT_TL)
    assert usage.decode_gpu_s == pytest.approx(0.6)  # 3.6 s streamed, 3 s of it a stall
    assert usage.tpot_s == pytest.approx(3.6 / 6)  # what the client saw


def test_a_local_note_names_an_instance_the_region_is_billed() -> None:
    """Notes of a fleet say `local in REGION/INSTANCE` (an instance ran it); prices are per region."""
    job = {k: v for k, v in SPLIT.items() if k != "regions_a1"} | {"placement_chosen": "local"}
    tl = _tl(("LOCAL", 1, 0, "local in dec/0"), ("QUEUED", 2, 1.0, "lost"))
    assert wasted_work(job, tl, range(1, 2)) == [Work(1, "local", "dec", 1.0, "lost")]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"state": "DONE"}, True),
        ({"state": "CANCELED", "client_canceled": "1", "cut_tokens": "4"}, True),
        ({"state": "CANCELED", "client_canceled": "1"}, False),  # before its first token: the platform's cost
        ({"state": "CANCELED", "cut_tokens": "4"}, False),  # canceled by the platform (its deadline)
        ({"state": "FAILED", "client_canceled": "1", "cut_tokens": "4"}, False),
        # recorded for attempt 1, which failed over before the cancel: attempt 1 is the platform's cost
        ({"state": "CANCELED", "client_canceled": "1", "cut_tokens": "4", "cut_attempt": "1", "attempt": "2"}, False),
        ({"state": "CANCELED", "client_canceled": "1", "cut_tokens": "4", "cut_attempt": "2", "attempt": "2"}, True),
        # its first token came after the cancel (to a process the cancel did not reach): not the tenant's
        (
            {
                "state": "CANCELED",
                "client_canceled": "1",
                "cut_tokens": "2",
                "cut_first_at": "10.5",
                "canceled_at": "10",
            },
            False,
        ),
        (
            {
                "state": "CANCELED",
                "client_canceled": "1",
                "cut_tokens": "2",
                "cut_first_at": "9.5",
                "canceled_at": "10",
            },
            True,
        ),
    ],
)
def test_billable_jobs(fields: dict[str, str], expected: bool) -> None:
    assert billable(fields) is expected


def test_a_job_its_client_cut_is_billed_up_to_the_cut() -> None:
    """A split job canceled by its client after 4 tokens: prefill as recorded, decode first token to the last one
    its follower got, 4 tokens out, finished when it was canceled."""
    job = SPLIT | {"state": "CANCELED", "client_canceled": "1", "placement_chosen": "split", "attempt": "1",
                   "prefill_gpu_s": "0.7", "cut_tokens": "4", "cut_first_at": str(T + 1.0), "cut_first_s": "0.1",
                   "cut_last_s": "0.4", "created_at": str(T), "updated_at": str(T + 9)}  # fmt: skip
    tl = _tl(("PREFILLING", 1, 0, ""), ("TRANSFERRING", 1, 0.7, ""), ("DECODING", 1, 1.0, ""),
             ("CANCELED", 1, 1.5, "client disconnected"))  # fmt: skip
    usage = job_usage(job, tl)
    assert (usage.prefill_gpu_s, usage.decode_gpu_s, usage.tokens_out) == (0.7, pytest.approx(0.3), 4)
    assert usage.ttft_s == pytest.approx(1.0) and usage.tpot_s == pytest.approx(0.1)
    assert usage.finished_at is not None and usage.finished_at.timestamp() == pytest.approx(T + 1.5)


def test_a_cut_job_is_billed_no_decode_after_its_cancel() -> None:
    """Its follower recorded a token that came 3 s after token 0, 2 s of it a stall (the region stopped), but the
    job was canceled 0.1 s after token 0: 0.1 s of decode, not 1 s."""
    job = SPLIT | {"state": "CANCELED", "client_canceled": "1", "cut_tokens": "4", "cut_first_at": str(T + 1.0),
                   "cut_first_s": "0.1", "cut_last_s": "3.1", "cut_stall_s": "2.0"}  # fmt: skip
    tl = _tl(("PREFILLING", 1, 0, ""), ("TRANSFERRING", 1, 0.7, ""), ("DECODING", 1, 1.0, ""),
             ("CANCELED", 1, 1.1, "canceled by the tenant"))  # fmt: skip
    assert job_usage(job, tl).decode_gpu_s == pytest.approx(0.1)


def test_a_stall_of_a_two_choice_stream_is_counted_once() -> None:
    """Two choices, 10 ms steps, then the region stops 5 s: the stall is the stream's 5 s less one step, counted
    once (each choice's gap spans it, the second choice's token came 1 ms after the first's)."""
    output = Outputs(())
    events = [(s * 0.01 + c * 0.001, c) for s in range(4) for c in (0, 1)]
    events += [(5.04 + c * 0.001, c) for c in (0, 1)] + [(5.05 + c * 0.001, c) for c in (0, 1)]
    for elapsed, choice in events:
        timing = output.timed(1, (T, 0.0), elapsed, choice)
    assert timing.stall_s == pytest.approx(5.04 - 0.031 - 0.01, abs=1e-6)
