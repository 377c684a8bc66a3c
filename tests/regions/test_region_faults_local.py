"""Admission, tickets, cancel, deadlines and bad input on agents in this process
(tiny-llama, real gRPC servers and KV sockets on loopback)."""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from region_kit import (
    FORGER,
    Region,
    cancel,
    decode_request,
    generate_tokens,
    local_region,
    new_job,
    prefill_request,
    reserve,
    split_generate,
    ticket,
    wait_until,
)

from prfaas.decode_region import metrics as decode_metrics
from prfaas.decode_region.hf_backend import Assembly
from prfaas.devstack.processes import free_port
from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.prefill_region.hf_backend import HFPrefill
from prfaas.prefill_region.job import Job
from prfaas.protos.prfaas.v1 import common_pb2, decode_pb2, prefill_pb2
from prfaas.region.errors import Canceled
from prfaas.region.requests import MAX_RESHIPS, sampling_to_proto

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
CAPACITY = 64 << 20


@pytest.fixture(scope="module")
def region(tiny_engine: HFEngine) -> Iterator[Region]:
    region = local_region(tiny_engine, kv_buffer_bytes=CAPACITY, workers=2)
    yield region
    region.close()


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    """The status `call` fails with (a streaming call is read to its end)."""
    try:
        result = call()
        if isinstance(result, Iterable):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return, attr-defined]
    raise AssertionError("the call succeeded")


def test_buffer_full_is_resource_exhausted_and_frees_on_release(region: Region) -> None:
    stub = region.decode_stub
    assert _code(lambda: reserve(stub, new_job(), CAPACITY + 1)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    first = new_job()
    reserve(stub, first, CAPACITY - 1000)
    with pytest.raises(grpc.RpcError) as info:
        reserve(stub, new_job(), 2000)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV buffer full: job needs 2000 bytes, 1000 of" in info.value.details()
    assert stub.Release(decode_pb2.ReleaseRequest(job_id=first), timeout=5).found
    assert not stub.Release(decode_pb2.ReleaseRequest(job_id=first), timeout=5).found  # idempotent
    reserve(stub, second := new_job(), 2000)
    cancel(stub, second)
    assert region.decode is not None and region.decode.book.used_bytes == 0


def test_a_stale_attempts_release_keeps_the_newer_attempts_reservation(region: Region) -> None:
    stub, job_id = region.decode_stub, new_job()
    reserve(stub, job_id, 1000, attempt=1)
    reserve(stub, job_id, 1000, attempt=2)  # supersedes attempt 1's
    assert not stub.Release(decode_pb2.ReleaseRequest(job_id=job_id, attempt=1), timeout=5).found
    assert region.decode is not None and region.decode.book.used_bytes == 1000  # attempt 2 still holds it
    assert stub.Release(decode_pb2.ReleaseRequest(job_id=job_id, attempt=2), timeout=5).found
    assert region.decode.book.used_bytes == 0


def test_a_stale_attempts_cancel_keeps_the_newer_attempts_work(region: Region, tiny_engine: HFEngine) -> None:
    """A Cancel names the attempt it stops, with the older ones (the sweeper acts on a job record it read a
    moment ago, and another process may have started the next attempt since): attempt 2's reservation and
    KV lease outlive a Cancel of attempt 1, not one of attempt 2."""
    assert region.decode is not None
    job_id = new_job()
    reserve(region.decode_stub, job_id, 1000, attempt=2)
    region.leases.put(job_id, tiny_engine.prefill(list(range(1, 17)), GREEDY), attempt=2)
    stale = common_pb2.CancelRequest(job_id=job_id, reason="test", attempt=1)
    assert not region.decode_stub.Cancel(stale, timeout=5).found
    assert not region.prefill_stub.Cancel(stale, timeout=5).found
    assert region.decode.book.used_bytes == 1000 and job_id in region.leases.job_ids()
    current = common_pb2.CancelRequest(job_id=job_id, reason="test", attempt=2)
    assert region.decode_stub.Cancel(current, timeout=5).found
    assert region.prefill_stub.Cancel(current, timeout=5).found
    assert region.decode.book.used_bytes == 0 and job_id not in region.leases.job_ids()


@pytest.mark.parametrize("lands_in", ["expect", "watch"])
def test_a_cancel_while_reserve_sets_up_leaves_no_hold_or_watch(
    region: Region, monkeypatch: pytest.MonkeyPatch, lands_in: str
) -> None:
    """A tenant's Cancel that lands while Reserve is between booking the bytes and attaching the hold and the
    prefill region's watch: Reserve answers CANCELLED, and the hold and the watch it made are ended, not
    left running for a reservation that is gone (landing as the hold is made, no watch is opened at all)."""
    decode = region.decode
    assert decode is not None
    made: dict[str, Any] = {}
    expect, watch = decode.backend.expect, decode.watcher.watch

    def expect_as_the_cancel_lands(expected: Any, ttl_s: float, events: Any) -> Any:
        if lands_in == "expect":
            decode.cancel(expected.job_id, Canceled("canceled by the tenant"))
        made["hold"] = expect(expected, ttl_s, events)
        return made["hold"]

    def recorded_watch(*args: Any, **kwargs: Any) -> Any:
        if lands_in == "watch":
            decode.cancel(job_id, Canceled("canceled by the tenant"))
        made["watch"] = watch(*args, **kwargs)
        return made["watch"]

    monkeypatch.setattr(decode.backend, "expect", expect_as_the_cancel_lands)
    monkeypatch.setattr(decode.watcher, "watch", recorded_watch)
    job_id = new_job()
    target = region.server.grpc_address
    assert _code(lambda: reserve(region.decode_stub, job_id, 1000, prefill_grpc=target)) == grpc.StatusCode.CANCELLED
    if lands_in == "watch":
        assert made["watch"].stopped.is_set()
    else:
        assert "watch" not in made
    assert made["hold"].wait(time.monotonic() + 1, lambda: True) is False  # ended: nothing to wait for
    assert decode.book.used_bytes == 0
    assert not region.decode_stub.Release(decode_pb2.ReleaseRequest(job_id=job_id, attempt=1), timeout=5).found


def test_a_reserve_its_caller_left_frees_its_bytes_at_once(region: Region, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Reserve whose caller's deadline passed while the region was making it: the caller will neither use
    nor release it, so the region ends it then, not at its TTL (60 s here)."""
    decode = region.decode
    assert decode is not None
    expect = decode.backend.expect

    def slow_expect(expected: Any, ttl_s: float, events: Any) -> Any:
        time.sleep(1.0)  # a loaded region: the caller's 0.3 s deadline passes meanwhile
        return expect(expected, ttl_s, events)

    monkeypatch.setattr(decode.backend, "expect", slow_expect)
    job_id = new_job()
    request = decode_pb2.ReserveRequest(job_id=job_id, attempt=1, tenant="acme", kv_bytes=1000, ttl_s=60)
    assert _code(lambda: region.decode_stub.Reserve(request, timeout=0.3)) == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: job_id not in decode.held.reservations, timeout_s=5)
    assert decode.book.used_bytes == 0


def test_forged_ticket_stores_no_kv(region: Region, tiny_engine: HFEngine, long_text: str) -> None:
    ids = tiny_engine.encode(long_text)[:64]
    job_id = new_job()
    reply = reserve(region.decode_stub, job_id, len(ids) * tiny_engine.kv_bytes_per_token)
    received = decode_metrics.KV_RECEIVED._value.get()

    with pytest.raises(grpc.RpcError) as info:
        list(
            region.prefill_stub.Prefill(
                prefill_request(job_id, ids, GREEDY, reply.kv_endpoint, signer=FORGER), timeout=30
            )
        )

    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "ticket" in info.value.details()
    assert region.decode is not None
    hold = region.decode.held.reservations[job_id].hold
    assert isinstance(hold, Assembly) and hold.inbound.info is None  # never opened: no KV stored
    assert decode_metrics.KV_RECEIVED._value.get() == received
    cancel(region.decode_stub, job_id)


LONG_DECODE = SamplingParams(max_new_tokens=3000, ignore_eos=True)


def _decoding(region: Region, engine: HFEngine, ids: list[int]) -> tuple[str, int, Iterator[decode_pb2.TokenEvent]]:
    """A job reserved, prefilled and shipped, with its long decode started: (job id, KV bytes, the stream)."""
    job_id = new_job()
    kv_bytes = len(ids) * engine.kv_bytes_per_token
    reply = reserve(region.decode_stub, job_id, kv_bytes)
    request = prefill_request(job_id, ids, LONG_DECODE, reply.kv_endpoint, budget=kv_bytes)
    done = next(e for e in region.prefill_stub.Prefill(request, timeout=30) if e.HasField("prefill_done"))
    stream = region.decode_stub.Decode(decode_request(job_id, LONG_DECODE, done.prefill_done, timeout_s=60), timeout=60)
    return job_id, kv_bytes, stream


def test_cancel_mid_decode_frees_buffer_at_once(region: Region, tiny_engine: HFEngine, long_text: str) -> None:
    job_id, kv_bytes, stream = _decoding(region, tiny_engine, tiny_engine.encode(long_text)[:64])
    seen = [next(stream) for _ in range(5)]
    assert region.decode is not None and region.decode.book.used_bytes == kv_bytes

    assert cancel(region.decode_stub, job_id)

    assert region.decode.book.used_bytes == 0  # at once: before the decode loop even noticed
    with pytest.raises(grpc.RpcError) as info:
        seen += list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert len(seen) < LONG_DECODE.max_new_tokens


def test_client_disconnect_frees_reservation(region: Region, tiny_engine: HFEngine, long_text: str) -> None:
    _, _, stream = _decoding(region, tiny_engine, tiny_engine.encode(long_text)[:32])
    next(stream)
    stream.cancel()
    assert region.decode is not None
    decode = region.decode
    elapsed = wait_until(lambda: decode.book.used_bytes == 0, 2.0)
    assert elapsed < 1.0


def test_reservation_expires_and_decode_gets_deadline(region: Region, tiny_engine: HFEngine) -> None:
    job_id = new_job()
    reserve(region.decode_stub, job_id, 1000, ttl_s=0.3)
    assert region.decode is not None
    decode = region.decode
    wait_until(lambda: decode.book.used_bytes == 0, 3.0)
    kv = common_pb2.KVDescriptor(model_fingerprint=tiny_engine.fingerprint, dtype="float32", num_tokens=4)
    request = decode_request(job_id, GREEDY, kv=kv)
    assert _code(lambda: region.decode_stub.Decode(request, timeout=5)) == grpc.StatusCode.DEADLINE_EXCEEDED


def _decode_of(fingerprint: str) -> decode_pb2.DecodeRequest:
    """A Decode of a new job whose KV (float32) came from the model `fingerprint`."""
    kv = common_pb2.KVDescriptor(model_fingerprint=fingerprint, dtype="float32")
    return decode_request(new_job(), GREEDY, kv=kv, timeout_s=0)


@pytest.mark.parametrize(
    ("make", "code", "detail"),
    [
        (
            lambda s, e: s.decode_stub.Reserve(decode_pb2.ReserveRequest(job_id="job-1", kv_bytes=1), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job_id must be a UUID",
        ),
        (
            lambda s, e: s.decode_stub.Reserve(decode_pb2.ReserveRequest(job_id=new_job(), kv_bytes=0), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "kv_bytes must be > 0",
        ),
        (
            lambda s, e: s.decode_stub.Reserve(
                decode_pb2.ReserveRequest(job_id=new_job(), kv_bytes=1, ttl_s=-1), timeout=5
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "ttl_s must be in",
        ),
        (
            lambda s, e: list(
                s.decode_stub.Generate(
                    decode_pb2.GenerateRequest(
                        job_id=new_job(), token_ids=[e.vocab_size + 5], sampling=sampling_to_proto(GREEDY)
                    ),
                    timeout=5,
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside the vocabulary",
        ),
        (
            lambda s, e: list(
                s.decode_stub.Generate(
                    decode_pb2.GenerateRequest(
                        job_id=new_job(),
                        token_ids=[1],
                        sampling=common_pb2.SamplingParams(max_new_tokens=2, temperature=0.5),
                    ),
                    timeout=5,
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "seed is required",
        ),
        (
            lambda s, e: list(s.decode_stub.Decode(_decode_of(e.fingerprint), timeout=5)),
            grpc.StatusCode.NOT_FOUND,
            "no reservation for job",
        ),
        (
            lambda s, e: list(s.decode_stub.Decode(_decode_of("f" * 64), timeout=5)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "cannot be decoded by this region",
        ),
        (
            lambda s, e: list(s.prefill_stub.Prefill(prefill_request(new_job(), [], GREEDY, "127.0.0.1:1"), timeout=5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids is empty",
        ),
        (
            lambda s, e: list(s.prefill_stub.Prefill(prefill_request(new_job(), [1, 2], GREEDY, "nowhere"), timeout=5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "destination.kv_endpoint",
        ),
        (
            lambda s, e: list(
                s.prefill_stub.Prefill(
                    prefill_request(new_job(), [1, 2], GREEDY, "127.0.0.1:1", codec="zip"), timeout=5
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "destination.codec 'zip'",
        ),
        (
            lambda s, e: list(
                s.prefill_stub.Prefill(prefill_request(new_job(), [1] * 5000, GREEDY, "127.0.0.1:1"), timeout=5)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceeds the model",
        ),
        (
            lambda s, e: s.prefill_stub.Reship(
                prefill_pb2.ReshipRequest(
                    job_id=new_job(),
                    attempt=2,
                    destination=prefill_pb2.Destination(kv_endpoint="127.0.0.1:1", ticket="t"),
                ),
                timeout=5,
            ),
            grpc.StatusCode.NOT_FOUND,
            "no KV lease for job",
        ),
    ],
)
def test_bad_input_gets_a_status_with_a_stable_message(
    region: Region, tiny_engine: HFEngine, make: object, code: grpc.StatusCode, detail: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        make(region, tiny_engine)  # type: ignore[operator]
    assert info.value.code() == code
    assert detail in info.value.details()


def test_region_still_serves_after_bad_input(region: Region, tiny_engine: HFEngine) -> None:
    assert generate_tokens(region.decode_stub, [1, 2, 3], GREEDY) == tiny_engine.generate([1, 2, 3], GREEDY)


def test_full_prefill_queue_is_resource_exhausted_and_cancel_stops_the_job(tiny_engine: HFEngine) -> None:
    region = local_region(tiny_engine, decode=False, workers=1, queue_depth=0)
    try:
        dead = f"127.0.0.1:{free_port()}"  # nothing listens: the transfer retries until PeerUnavailable (5 s)
        job_id = new_job()
        stream = region.prefill_stub.Prefill(prefill_request(job_id, [1, 2, 3] * 20, GREEDY, dead), timeout=30)
        assert next(stream).HasField("started")

        with pytest.raises(grpc.RpcError) as info:
            list(region.prefill_stub.Prefill(prefill_request(new_job(), [1, 2, 3], GREEDY, dead), timeout=5))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "prefill queue full" in info.value.details()

        start = time.monotonic()
        assert cancel(region.prefill_stub, job_id)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - start < 1.0
        assert region.prefill is not None
        prefill = region.prefill
        wait_until(prefill.idle, 2.0)
    finally:
        region.close()


def test_reship_from_lease_to_another_decode_region(tiny_engine: HFEngine, long_text: str) -> None:
    a = local_region(tiny_engine)
    b = local_region(tiny_engine, prefill=False)
    try:
        ids = tiny_engine.encode(long_text)[:100]
        kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token
        first = split_generate(a.prefill_stub, a.decode_stub, ids, GREEDY, kv_bytes)
        job_id = first.job_id  # its KV stays leased in region a after the first decode

        reply = reserve(b.decode_stub, job_id, kv_bytes, attempt=2)
        shipped = a.prefill_stub.Reship(
            prefill_pb2.ReshipRequest(
                job_id=job_id,
                attempt=2,
                destination=prefill_pb2.Destination(
                    kv_endpoint=reply.kv_endpoint, ticket=ticket(job_id, 2, budget=kv_bytes), codec="raw"
                ),
                timeout_s=30,
            ),
            timeout=30,
        )
        assert shipped.shipment.raw_bytes == kv_bytes
        request = decode_request(job_id, GREEDY, shipped, attempt=2, timeout_s=30)
        assert [e.token for e in b.decode_stub.Decode(request, timeout=30)] == first.tokens
    finally:
        a.close()
        b.close()


def test_leases_past_their_byte_cap_are_dropped_oldest_first(tiny_engine: HFEngine) -> None:
    region = local_region(tiny_engine, decode=False)
    try:
        leases = region.leases
        one = tiny_engine.prefill(list(range(1, 33)), GREEDY)
        leases.max_bytes = 2 * one.kv.nbytes
        jobs = [new_job() for _ in range(3)]
        for job_id in jobs:
            leases.put(job_id, one)
        assert leases.job_ids() == jobs[1:]
    finally:
        region.close()


@pytest.fixture
def silent_kv_port() -> Iterator[str]:
    """A KV endpoint that accepts connections and never answers."""
    hole = socket.create_server(("127.0.0.1", 0), backlog=64)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(hole.accept()[0]) for _ in range(64)], daemon=True).start()
    yield f"127.0.0.1:{hole.getsockname()[1]}"
    hole.close()


def test_a_shipment_past_the_job_deadline_is_deadline_exceeded(tiny_engine: HFEngine, silent_kv_port: str) -> None:
    """(Before: CANCELLED, "canceled by the sender", which docs/regions.md keeps for Cancel and disconnects.)"""
    region = local_region(tiny_engine, decode=False)
    try:
        request = prefill_request(new_job(), tiny_engine.encode("no one reads this KV"), GREEDY, silent_kv_port,
                                  timeout_s=1)  # fmt: skip
        assert _code(lambda: region.prefill_stub.Prefill(request, timeout=30)) == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        region.close()


def test_a_queued_prefill_ends_at_its_own_deadline_and_frees_its_slot(
    tiny_engine: HFEngine, silent_kv_port: str
) -> None:
    """One worker, held by a job shipping to a KV port that accepts and never answers: a job queued behind it
    with a 1 s timeout ends DEADLINE_EXCEEDED at about 1 s, its queue slot freed (before, at the first job's
    end, 25 s later in the probe), and a queued job canceled ends at once."""
    region = local_region(tiny_engine, decode=False, workers=1, queue_depth=4)
    assert region.registration.queue_limit == 4  # what the scheduler's capacity filter reads
    endpoint = silent_kv_port
    ids = tiny_engine.encode("the worker is busy shipping to a port that never answers")
    try:
        busy = region.prefill_stub.Prefill(prefill_request(new_job(), ids, GREEDY, endpoint, timeout_s=20), timeout=30)
        next(busy)  # started: the worker is taken
        started = time.monotonic()
        queued = prefill_request(new_job(), ids, GREEDY, endpoint, timeout_s=1)
        assert _code(lambda: region.prefill_stub.Prefill(queued, timeout=30)) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 3.0
        assert region.prefill is not None and region.prefill.load()["queue_depth"] == 0
        canceled = prefill_request(new_job(), ids, GREEDY, endpoint, timeout_s=20)
        stream = region.prefill_stub.Prefill(canceled, timeout=30)
        wait_until(lambda: region.prefill is not None and region.prefill.load()["queue_depth"] == 1, timeout_s=5)
        started = time.monotonic()
        cancel(region.prefill_stub, canceled.job_id)
        assert _code(lambda: stream) == grpc.StatusCode.CANCELLED and time.monotonic() - started < 2.0
        busy.cancel()
    finally:
        region.close()


def test_decodes_waiting_for_kv_leave_threads_for_health_reserve_and_cancel(tiny_engine: HFEngine) -> None:
    """24 Decodes whose KV has not come each hold a gRPC thread: health, Reserve and Cancel still answer (the
    server's pool counts max_jobs in; before, 24 took the whole pool of a 1-worker region and health checks
    timed out, so the region looked dead and could not even be canceled). Past max_jobs, Reserve and
    Generate are RESOURCE_EXHAUSTED."""
    region = local_region(tiny_engine, prefill=False, workers=1, queue_depth=4, max_jobs=26)
    health = health_pb2_grpc.HealthStub(region.channel)
    kv = common_pb2.KVDescriptor(model_fingerprint=tiny_engine.fingerprint, dtype=tiny_engine.dtype, num_tokens=10)
    jobs = [new_job() for _ in range(24)]
    calls = []
    try:
        for job_id in jobs:
            reserve(region.decode_stub, job_id, 1 << 20)
        calls = [region.decode_stub.Decode(decode_request(j, GREEDY, kv=kv), timeout=60) for j in jobs]
        waiting = [threading.Thread(target=_code, args=(lambda c=c: c,), daemon=True) for c in calls]
        for thread in waiting:
            thread.start()
        time.sleep(1.0)  # every Decode is in the region, waiting for its KV
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reserve(region.decode_stub, new_job(), 1 << 20)  # the 25th job
        assert cancel(region.decode_stub, jobs[0])
        for _ in range(2):  # 24 again after the cancel, then 26: max_jobs
            reserve(region.decode_stub, new_job(), 1 << 20)
        full = grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _code(lambda: reserve(region.decode_stub, new_job(), 1 << 20)) == full
        assert _code(lambda: generate_tokens(region.decode_stub, [1, 2, 3], GREEDY)) == full
    finally:
        for call in calls:
            call.cancel()
        region.close()


def test_a_decode_region_reports_its_time_per_job(region: Region) -> None:
    """What a job queued there waits per job ahead of it (the scheduler's queue wait for a decode region)."""
    assert region.decode is not None
    generate_tokens(region.decode_stub, [1, 2, 3, 4], GREEDY)
    assert 0.0 < region.decode.load()["mean_job_s"] < 30.0
    assert region.server.load().mean_job_s == region.decode.load()["mean_job_s"]


def test_a_cancel_stops_a_reship_in_progress(tiny_engine: HFEngine, long_text: str, silent_kv_port: str) -> None:
    """A Reship shipping to a decode region that never reads stops at the job's Cancel, not at its own
    deadline (before, the Cancel dropped the lease and the transfer went on for its whole timeout)."""
    a = local_region(tiny_engine)
    try:
        ids = tiny_engine.encode(long_text)[:100]
        kv_bytes = len(ids) * tiny_engine.kv_bytes_per_token
        job_id = split_generate(a.prefill_stub, a.decode_stub, ids, GREEDY, kv_bytes).job_id  # its KV leased in a
        destination = prefill_pb2.Destination(
            kv_endpoint=silent_kv_port, ticket=ticket(job_id, 2, budget=kv_bytes), codec="raw"
        )
        request = prefill_pb2.ReshipRequest(job_id=job_id, attempt=2, destination=destination, timeout_s=30)
        call = a.prefill_stub.Reship.future(request, timeout=40)
        time.sleep(1.0)  # the transfer is under way, to a reader that never answers
        started = time.monotonic()
        assert a.prefill_stub.Cancel(common_pb2.CancelRequest(job_id=job_id, reason="test", attempt=2), timeout=5).found
        assert _code(call.result) == grpc.StatusCode.CANCELLED and time.monotonic() - started < 5.0
    finally:
        a.close()


def _reship(region: Region, job_id: str, attempt: int, port: str) -> grpc.Future:
    destination = prefill_pb2.Destination(kv_endpoint=port, ticket=ticket(job_id, attempt), codec="raw")
    request = prefill_pb2.ReshipRequest(job_id=job_id, attempt=attempt, destination=destination, timeout_s=30)
    return region.prefill_stub.Reship.future(request, timeout=40)


def test_reships_are_bounded_and_each_one_is_stopped_by_its_cancel(tiny_engine: HFEngine, silent_kv_port: str) -> None:
    """Re-shipments to a decode region that never reads (one died with many jobs in flight): past MAX_RESHIPS
    they are RESOURCE_EXHAUSTED at once, and the region still answers health checks, Cancels and Prefills
    (before, each held a server thread for its whole timeout: 24 of them took all 20, and the region looked
    dead). Two Reships of one job (attempts 2 and 3) both end at the job's Cancel (before, only the newer)."""
    region = local_region(tiny_engine, decode=False, workers=1, queue_depth=0)
    try:
        kv = tiny_engine.prefill(list(range(1, 33)), GREEDY)
        jobs = [new_job() for _ in range(MAX_RESHIPS + 2)]
        for job_id in jobs:
            region.leases.put(job_id, kv, attempt=1)
        calls = [_reship(region, job_id, 2, silent_kv_port) for job_id in jobs[:MAX_RESHIPS]]
        wait_until(lambda: sum(len(c) for c in region.prefill._reships.values()) == MAX_RESHIPS, timeout_s=10)
        assert _code(_reship(region, jobs[-2], 2, silent_kv_port).result) == grpc.StatusCode.RESOURCE_EXHAUSTED
        health = health_pb2_grpc.HealthStub(region.channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=3).status == 1  # SERVING
        started = time.monotonic()
        assert cancel(region.prefill_stub, jobs[0])
        assert _code(calls[0].result) == grpc.StatusCode.CANCELLED and time.monotonic() - started < 5.0

        again = _reship(region, jobs[1], 3, silent_kv_port)  # a second Reship of jobs[1], beside attempt 2's
        wait_until(lambda: len(region.prefill._reships.get(jobs[1], [])) == 2, timeout_s=10)
        started = time.monotonic()
        assert cancel(region.prefill_stub, jobs[1])
        assert _code(calls[1].result) == _code(again.result) == grpc.StatusCode.CANCELLED
        assert time.monotonic() - started < 5.0
        for call in calls[2:]:
            call.cancel()
    finally:
        region.close()


def test_a_draining_region_refuses_reships_and_waits_for_those_in_progress(
    tiny_engine: HFEngine, silent_kv_port: str
) -> None:
    """Draining, a Reship is UNAVAILABLE as a Prefill is, and one in progress keeps the region from idle (before,
    drain took the region down under it at once, and the caller read CANCELLED)."""
    region = local_region(tiny_engine, decode=False)
    try:
        assert region.prefill is not None
        kv = tiny_engine.prefill(list(range(1, 33)), GREEDY)
        running, refused = new_job(), new_job()
        for job_id in (running, refused):
            region.leases.put(job_id, kv, attempt=1)
        call = _reship(region, running, 2, silent_kv_port)
        wait_until(lambda: region.prefill is not None and running in region.prefill._reships, timeout_s=10)
        region.prefill.draining = True  # as RegionServer.drain sets it
        assert _code(_reship(region, refused, 2, silent_kv_port).result) == grpc.StatusCode.UNAVAILABLE
        assert not region.prefill.idle()
        call.cancel()
        wait_until(lambda: region.prefill is not None and region.prefill.idle(), timeout_s=10)
    finally:
        region.close()


def test_a_cancel_near_the_end_of_the_forward_leaves_no_kv_lease(
    tiny_engine: HFEngine, silent_kv_port: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Cancel after the last layer's boundary, while the rest of the forward computes (here stretched to 1 s):
    the job ends CANCELLED and keeps no KV lease (before, the lease was put after the Cancel had dropped none,
    held for kv_lease_s, and a Reship of the canceled job shipped it); a Reship of the canceled job is refused."""
    prefill, last = tiny_engine.prefill, tiny_engine.facts.num_layers - 1

    def slow_tail(token_ids: list[int], params: SamplingParams, on_layer: Any = None, **kwargs: Any) -> Any:
        def layer(index: int, k: Any, v: Any) -> None:
            on_layer(index, k, v)
            if index == last:
                time.sleep(1.0)  # the compute after the last layer wrote its KV

        return prefill(token_ids, params, on_layer=layer, **kwargs)

    monkeypatch.setattr(tiny_engine, "prefill", slow_tail)
    region = local_region(tiny_engine, decode=False)
    try:
        job_id = new_job()
        request = prefill_request(job_id, tiny_engine.encode("canceled near its end"), GREEDY, silent_kv_port,
                                  timeout_s=20)  # fmt: skip
        stream = region.prefill_stub.Prefill(request, timeout=30)
        for event in stream:
            if event.HasField("layer_shipped") and event.layer_shipped.layer == last:
                break
        time.sleep(0.2)  # inside the tail of the forward
        assert cancel(region.prefill_stub, job_id)
        assert _code(lambda: stream) == grpc.StatusCode.CANCELLED
        time.sleep(1.0)
        assert job_id not in region.leases.job_ids()
        region.leases.put(job_id, prefill([1, 2, 3], GREEDY), attempt=1)  # a lease left some other way:
        assert _code(lambda: _reship(region, job_id, 2, silent_kv_port).result()) == grpc.StatusCode.CANCELLED
    finally:
        region.close()


def test_a_cancel_that_comes_before_its_prefill_is_remembered(tiny_engine: HFEngine, silent_kv_port: str) -> None:
    """Cancel and Prefill travel on channels of their own: a Cancel of attempt 1 that arrives first refuses
    attempt 1's Prefill (CANCELLED; before, it was forgotten and the canceled job ran and shipped its KV), and
    lets attempt 2's run."""
    region = local_region(tiny_engine, decode=False)
    try:
        job_id, ids = new_job(), tiny_engine.encode("canceled before it came")
        assert not region.prefill_stub.Cancel(common_pb2.CancelRequest(job_id=job_id, reason="t", attempt=1),
                                              timeout=5).found  # fmt: skip
        first = prefill_request(job_id, ids, GREEDY, silent_kv_port, attempt=1, timeout_s=5)
        assert _code(lambda: region.prefill_stub.Prefill(first, timeout=10)) == grpc.StatusCode.CANCELLED
        second = region.prefill_stub.Prefill(prefill_request(job_id, ids, GREEDY, silent_kv_port, attempt=2,
                                                             timeout_s=5), timeout=10)  # fmt: skip
        assert next(second).HasField("started")
        second.cancel()
    finally:
        region.close()


def test_a_newer_attempt_supersedes_an_older_one_still_computing(tiny_engine: HFEngine, silent_kv_port: str) -> None:
    """Attempt 2 while attempt 1 still computes (its Cancel lost, or not yet landed): attempt 1 is stopped and
    attempt 2 starts, as a decode region's Reserve supersedes an older attempt (before, ALREADY_EXISTS, and the
    control plane left this instance out of the job)."""
    region = local_region(tiny_engine, decode=False)
    try:
        assert region.prefill is not None and isinstance(region.prefill.backend, HFPrefill)
        region.prefill.backend.test_layer_delay_s = 0.5
        job_id, ids = new_job(), tiny_engine.encode("retried at once")
        older = region.prefill_stub.Prefill(prefill_request(job_id, ids, GREEDY, silent_kv_port, attempt=1),
                                            timeout=30)  # fmt: skip
        next(older)  # started
        newer = region.prefill_stub.Prefill(prefill_request(job_id, ids, GREEDY, silent_kv_port, attempt=2,
                                                            timeout_s=5), timeout=10)  # fmt: skip
        assert next(newer).HasField("started")
        assert _code(lambda: older) == grpc.StatusCode.CANCELLED
        newer.cancel()
    finally:
        region.close()


def test_queued_jobs_that_ended_keep_no_prompt_while_their_runs_wait(
    tiny_engine: HFEngine, silent_kv_port: str
) -> None:
    """One worker held by a shipment no one reads; queued jobs end at their 0.3 s deadline and free their slots,
    but each one's run waits in the worker pool until the worker frees: without its prompt (before, each kept
    its token ids: 4,000-token prompts at a high rate grew memory without bound)."""
    region = local_region(tiny_engine, decode=False, workers=1, queue_depth=2)
    try:
        assert region.prefill is not None
        busy = region.prefill_stub.Prefill(prefill_request(new_job(), [5] * 50, GREEDY, silent_kv_port,
                                                            timeout_s=60), timeout=70)  # fmt: skip
        next(busy)  # the worker is held
        for _ in range(5):
            requests = [prefill_request(new_job(), [7] * 4000, GREEDY, silent_kv_port, timeout_s=0.3) for _ in "ab"]
            calls = [region.prefill_stub.Prefill(request, timeout=10) for request in requests]
            for call in calls:
                assert _code(lambda c=call: c) == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[misc]
        gc.collect()
        kept = [job for job in gc.get_objects() if type(job) is Job and len(job.work.token_ids) == 4000]
        assert kept == []  # the 10 ended jobs' runs wait in the pool, and hold no prompt
        busy.cancel()
    finally:
        region.close()


def test_a_local_generate_canceled_during_its_prefill_ends_at_the_next_layer(
    tiny_engine: HFEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local Generate's prefill (stretched to 0.5 s a layer, 2 s in all) stops at the layer after its Cancel,
    with no token sent (before, the prefill ran to its end, holding its worker, and token 0 went out after the
    Cancel). Its deadline stops it the same way."""
    prefill = tiny_engine.prefill

    def slow(token_ids: list[int], params: SamplingParams, on_layer: Any = None, **kwargs: Any) -> Any:
        def layer(index: int, k: Any, v: Any) -> None:
            time.sleep(0.5)
            if on_layer is not None:
                on_layer(index, k, v)

        return prefill(token_ids, params, on_layer=layer, **kwargs)

    monkeypatch.setattr(tiny_engine, "prefill", slow)
    region = local_region(tiny_engine, prefill=False)
    try:
        request = decode_pb2.GenerateRequest(job_id=new_job(), token_ids=[1, 2, 3, 4], timeout_s=30,
                                             sampling=sampling_to_proto(GREEDY))  # fmt: skip
        stream = region.decode_stub.Generate(request, timeout=30)
        time.sleep(0.3)
        started = time.monotonic()
        assert cancel(region.decode_stub, request.job_id)
        with pytest.raises(grpc.RpcError) as info:
            next(stream)  # no token
        assert info.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - started < 1.0
        late = decode_pb2.GenerateRequest(job_id=new_job(), token_ids=[1, 2, 3, 4], timeout_s=0.7,
                                          sampling=sampling_to_proto(GREEDY))  # fmt: skip
        assert _code(lambda: region.decode_stub.Generate(late, timeout=30)) == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        region.close()


def test_a_job_canceled_while_it_waits_for_a_worker_ends_at_once(tiny_engine: HFEngine) -> None:
    """One decode worker, held by a paced Generate: a second one waiting for it ends CANCELLED as its Cancel
    lands, not when the worker frees (before, 6 s later in the API's batch test: the slot wait ignored it)."""
    region = local_region(tiny_engine, prefill=False, workers=1, token_delay_s=0.1)
    try:
        params = SamplingParams(max_new_tokens=60, ignore_eos=True)
        busy = decode_pb2.GenerateRequest(job_id=new_job(), token_ids=[1, 2, 3], sampling=sampling_to_proto(params),
                                          timeout_s=60)  # fmt: skip
        holding = region.decode_stub.Generate(busy, timeout=60)
        next(holding)  # it has the worker
        waiting = decode_pb2.GenerateRequest(job_id=new_job(), token_ids=[4, 5, 6], sampling=sampling_to_proto(params),
                                             timeout_s=60)  # fmt: skip
        stream = region.decode_stub.Generate(waiting, timeout=60)
        assert region.decode is not None
        wait_until(lambda: region.decode is not None and region.decode.workers.waiting == 1, timeout_s=5)
        started = time.monotonic()
        assert cancel(region.decode_stub, waiting.job_id)
        assert _code(lambda: stream) == grpc.StatusCode.CANCELLED and time.monotonic() - started < 1.0
        holding.cancel()
    finally:
        region.close()
