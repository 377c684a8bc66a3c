"""The GPU path, checked on one GPU in a few minutes (issue 25).

    python bench/gpu_check.py --json gpu.json [--model smollm2-135m] [--lengths 2048 4096 8176]
                              [--device auto] [--topology examples/topology.yaml]

Needs torch, transformers and what prfaas needs (no Redis, no control plane). For each prompt length:

1. In this process, the engine on the device (`device: auto`: the GPU when torch sees one), one prefill with
   each layer's K/V copied out of device memory as soon as the layer is done (engine/staging.py: an event per
   layer, a side stream, a bounded pool of pinned host buffers), timed with CUDA events:
   `overlap_pct`, the share of the copies' time that ran while the forward was still running;
   `layer_to_host_ms`, a layer's end to its bytes in host memory (mean); `d2h_gb_per_s`, the copies' rate
   (side stream into pinned buffers) beside `d2h_sync_gb_per_s` (a blocking `.cpu()` of the same tensors);
   `kv_bytes_per_s`, KV bytes produced per second of prefill, against each link of `--topology`. Then the
   decode side's upload of those bytes (engine/upload.py): `h2d_gb_per_s` through pinned buffers on a side
   stream, beside `h2d_sync_gb_per_s` (a blocking `.to(device)`), and `upload_wall_ms`.
2. Two region processes on the same device (`prfaas region`, a prefill and a decode region), driven over
   gRPC: `ttft_colocated_s` (Generate on the decode region) and `ttft_split_s` (Reserve, Prefill shipping
   each layer over TCP, Decode), each the median of `--repeats`; `tokens_identical`: the split job's greedy
   tokens equal the colocated job's.

`--json PATH` writes one row per length: prompt_tokens, ttft_colocated_s, ttft_split_s, tokens_identical,
kv_bytes_per_s, d2h_gb_per_s, overlap_pct (and the rest above). On a host without a GPU it runs on the CPU
(the copy figures are then null: a CPU tensor is already in host memory). Every call has a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml

from prfaas.devstack.processes import RegionProcess, spawn_region, write_region_config
from prfaas.engine.device import select_device
from prfaas.engine.hf import HFEngine
from prfaas.engine.kv import DTYPES
from prfaas.engine.models import prepare_model
from prfaas.engine.sampling import SamplingParams
from prfaas.engine.staging import CudaOps, HostPool, LayerCopier
from prfaas.engine.upload import LayerUploader
from prfaas.protos.prfaas.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prfaas.region.requests import sampling_to_proto
from prfaas.transport.tickets import TicketSigner

KEY = os.urandom(32).hex()
CALL_S = 120.0
NEW_TOKENS = 16
DEADLINE = [time.monotonic() + 290.0]  # the whole check (`--budget-s`): every call's timeout is what is left


def call_s(most: float = CALL_S) -> float:
    """A call's timeout: `most`, or what is left of the check's budget (TimeoutError once it is spent)."""
    left = DEADLINE[0] - time.monotonic()
    if left <= 1:
        raise TimeoutError("the check's time budget is spent (--budget-s)")
    return min(most, left)


def timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


class TimedCudaOps(CudaOps):
    """CudaOps that also times each copy (start and end events on the side stream) and each layer's end."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.spans: list[tuple[Any, Any]] = []
        self.layer_ends: list[Any] = []

    def layer_done(self) -> Any:
        event = timing_event()
        event.record(torch.cuda.current_stream(self.device))
        self.layer_ends.append(event)
        return event

    def copy_after(self, stream: Any, event: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        start, end = timing_event(), timing_event()
        with torch.cuda.stream(stream):
            if event is not None:  # a layer's copy waits for its end; an upload's, for the compute before it
                stream.wait_event(event)
            start.record(stream)
        done = super().copy_after(stream, event, pairs)
        with torch.cuda.stream(stream):
            end.record(stream)
        self.spans.append((start, end))
        return done


def copy_figures(engine: HFEngine, ids: list[int], pools: tuple[HostPool, HostPool]) -> dict[str, Any]:
    """One prefill with the layer copy on a side stream, timed; and the same bytes copied blocking. `pools`
    (prefill side, decode side) are kept across calls: a warm-up call first allocates their pinned buffers,
    whose allocation would otherwise run inside the timed forward (and stall the streams)."""
    device = engine.device
    ops = TimedCudaOps(device)
    copier = LayerCopier(ops, pools[0])
    staged: list[Any] = []
    begin, end = timing_event(), timing_event()

    def on_layer(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        staged.append(copier.stage(index, k, v))

    torch.cuda.synchronize(device)
    begin.record()
    t0 = time.perf_counter()
    result = engine.prefill(ids, SamplingParams(max_new_tokens=1), on_layer=on_layer)
    end.record()
    prefill_s = time.perf_counter() - t0
    received = []
    for layer in staged:
        k_bytes, v_bytes = copier.host_bytes(layer, CALL_S)
        received.append((bytes(k_bytes), bytes(v_bytes), result_shape(engine, layer.nbytes[0])))
    torch.cuda.synchronize(device)
    forward_ms = begin.elapsed_time(end)
    # a layer's end (its event on the compute stream) to its bytes in host memory (its copy's end event)
    to_host = [done.elapsed_time(stop) for done, (_, stop) in zip(ops.layer_ends, ops.spans, strict=False)]
    copied = sum(k + v for k, v in (layer.nbytes for layer in staged))
    overlapped = total = 0.0
    for start, stop in ops.spans:
        a, b = begin.elapsed_time(start), begin.elapsed_time(stop)  # ms after the forward began
        total += b - a
        overlapped += max(0.0, min(b, forward_ms) - a)
    copy_ms = sum(s.elapsed_time(e) for s, e in ops.spans)
    for layer in staged:
        copier.release(layer)
    tensors = [t for layer in result.kv.layers for t in (layer.k, layer.v)]
    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    for tensor in tensors:
        tensor.cpu()
    sync_s = time.perf_counter() - t1
    return upload_figures(engine, received, pools[1]) | {
        "forward_ms": forward_ms, "prefill_s": prefill_s, "kv_bytes": copied,
        "overlap_pct": 100.0 * overlapped / total if total else 0.0,
        "layer_to_host_ms": statistics.fmean(to_host) if len(to_host) == len(staged) else None,
        "d2h_gb_per_s": copied / (copy_ms / 1e3) / 1e9,
        "d2h_sync_gb_per_s": copied / sync_s / 1e9,
    }  # fmt: skip


def result_shape(engine: HFEngine, nbytes: int) -> tuple[int, int, int]:
    """[kv_heads, tokens, head_dim] of a layer part of `nbytes` in the engine's dtype."""
    facts = engine.facts
    per_token = facts.num_kv_heads * facts.head_dim * DTYPES[facts.dtype].itemsize
    return facts.num_kv_heads, nbytes // per_token, facts.head_dim


def upload_figures(engine: HFEngine, received: list[tuple[bytes, bytes, tuple[int, int, int]]],
                   pool: HostPool) -> dict[str, Any]:  # fmt: skip
    """The decode side (engine/upload.py): the layers' bytes, in pageable host memory as a receiver holds
    them, uploaded through pinned buffers on a side stream: `h2d_gb_per_s` (the copies' own rate),
    `upload_wall_ms` (the first layer's put to the last copy landed; the puts return at once) beside
    `h2d_sync_gb_per_s` (a blocking `.to(device)` of the same bytes)."""
    device, dtype = engine.device, DTYPES[engine.facts.dtype]
    ops = TimedCudaOps(device)
    upload = LayerUploader(ops, pool, device).begin(CALL_S)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    uploaded = [upload.put(part, shape, dtype) for k, v, shape in received for part in (k, v)]
    upload.finish()
    wall_s = time.perf_counter() - t0
    copy_ms = sum(s.elapsed_time(e) for s, e in ops.spans)
    nbytes = sum(len(k) + len(v) for k, v, _ in received)
    sources = [torch.frombuffer(bytearray(part), dtype=torch.uint8) for k, v, _ in received for part in (k, v)]
    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    for source in sources:
        source.to(device)
    torch.cuda.synchronize(device)
    sync_s = time.perf_counter() - t1
    assert len(uploaded) == len(sources)
    return {"h2d_gb_per_s": nbytes / (copy_ms / 1e3) / 1e9, "upload_wall_ms": 1e3 * wall_s,
            "h2d_sync_gb_per_s": nbytes / sync_s / 1e9}  # fmt: skip


def start_region(folder: Path, model: str, name: str, role: str, device: str) -> RegionProcess:
    config = {
        "name": name, "role": role, "model": model, "ticket_key": KEY, "codec": "raw", "kv_buffer_bytes": "4GiB",
        "device": device, "dtype": "auto", "listen": {"grpc": "127.0.0.1:0", "kv": "127.0.0.1:0"},
    }  # fmt: skip
    # a cold GPU host may take minutes to load the model: up to 300 s, not CALL_S
    return spawn_region(write_region_config(folder / f"{name}.yaml", config), timeout_s=call_s(300.0))


class RegionPair:
    """A prefill and a decode region process, driven over gRPC as the dispatcher and the API would."""

    def __init__(self, prefill: str, decode: str, kv_bytes_per_token: int) -> None:
        self.prefill = prefill_pb2_grpc.PrefillRegionStub(grpc.insecure_channel(prefill))
        self.decode = decode_pb2_grpc.DecodeRegionStub(grpc.insecure_channel(decode))
        self.signer = TicketSigner({"k1": KEY.encode()}, "k1")
        self.kv_bytes_per_token = kv_bytes_per_token
        self.params = sampling_to_proto(SamplingParams(max_new_tokens=NEW_TOKENS))

    def colocated(self, ids: list[int]) -> tuple[float, list[int]]:
        start, ttft, tokens = time.perf_counter(), 0.0, []
        request = decode_pb2.GenerateRequest(job_id=str(uuid.uuid4()), token_ids=ids, sampling=self.params,
                                             timeout_s=call_s())  # fmt: skip
        for event in self.decode.Generate(request, timeout=call_s()):
            ttft = ttft or time.perf_counter() - start
            tokens.append(event.token)
        return ttft, tokens

    def split(self, ids: list[int]) -> tuple[float, list[int]]:
        job, kv_bytes = str(uuid.uuid4()), len(ids) * self.kv_bytes_per_token
        reserve = decode_pb2.ReserveRequest(job_id=job, attempt=1, tenant="gpu-check", kv_bytes=kv_bytes,
                                            ttl_s=call_s())  # fmt: skip
        start = time.perf_counter()
        reply = self.decode.Reserve(reserve, timeout=min(10.0, call_s()))
        ticket = self.signer.issue(job, 1, "gpu-check", kv_bytes, ttl_s=call_s())
        destination = prefill_pb2.Destination(kv_endpoint=reply.kv_endpoint, codec="raw", ticket=ticket)
        request = prefill_pb2.PrefillRequest(job_id=job, attempt=1, tenant="gpu-check", token_ids=ids,
                                             sampling=self.params, timeout_s=call_s(),
                                             destination=destination)  # fmt: skip
        # The call stays referenced until the shipment ended: a dropped call is canceled, and the region then
        # cancels the job and its transfer (prefill_done comes before the last layers are shipped)
        prefill = self.prefill.Prefill(request, timeout=call_s())
        done = next(e.prefill_done for e in prefill if e.HasField("prefill_done"))
        decode = decode_pb2.DecodeRequest(job_id=job, attempt=1, first_token=done.first_token, kv=done.kv,
                                          sampling=self.params, timeout_s=call_s())  # fmt: skip
        ttft, tokens = 0.0, []
        for event in self.decode.Decode(decode, timeout=call_s()):
            ttft = ttft or time.perf_counter() - start
            tokens.append(event.token)
        for _ in prefill:  # the shipment's end
            pass
        return ttft, tokens


def link_rates(topology: Path) -> dict[str, float]:
    """Link name -> its rate in bytes/s, from a `prfaas up` topology file."""
    links = (yaml.safe_load(topology.read_text()) or {}).get("links") or []
    return {f"{x['src']}>{x['dst']}": float(x["rate_mbit"]) * 1e6 / 8 for x in links}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8176], help="prompt tokens")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--topology", type=Path, default=Path(__file__).parents[1] / "examples" / "topology.yaml")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--budget-s", type=float, default=290.0, help="the whole check's time limit")
    args = parser.parse_args()
    began = time.monotonic()
    DEADLINE[0] = began + args.budget_s
    signal.signal(signal.SIGTERM, _terminated)  # `finally` stops the region processes
    prepare_model(args.model)
    choice = select_device(args.device)
    print(f"device {choice.device} ({choice.name}), {choice.dtype}; {choice.reason}", flush=True)
    engine = HFEngine(args.model, dtype=choice.dtype, device=choice.device)
    vocab = engine.vocab_size
    links = link_rates(args.topology) if args.topology.exists() else {}
    rows: list[dict[str, Any]] = []
    pools = (HostPool(4 << 30, pinned=choice.is_cuda), HostPool(4 << 30, pinned=choice.is_cuda))
    failure = None
    with tempfile.TemporaryDirectory() as tmp:
        regions: list[RegionProcess] = []
        try:
            for role in ("prefill", "decode"):
                regions.append(start_region(Path(tmp), args.model, f"gpu-{role}", role, choice.device))
            pair = RegionPair(regions[0].grpc, regions[1].grpc, engine.kv_bytes_per_token)
            pair.colocated(list(range(100, 164)))  # warm both regions
            pair.split(list(range(100, 164)))
            for length in args.lengths:
                ids = [(7 * i + 13) % (vocab - 100) + 100 for i in range(length)]
                if choice.is_cuda:
                    copy_figures(engine, ids, pools)  # warm-up: the pools' pinned buffers of this length
                gpu = copy_figures(engine, ids, pools) if choice.is_cuda else {}
                runs = [(pair.colocated(ids), pair.split(ids)) for _ in range(args.repeats)]
                kv_bytes = length * engine.kv_bytes_per_token
                prefill_s = gpu.get("prefill_s") or min(c[0] for c, _ in runs)
                row = {
                    "prompt_tokens": length, "device": choice.device, "device_name": choice.name, "dtype": choice.dtype,
                    "ttft_colocated_s": statistics.median(c[0] for c, _ in runs),
                    "ttft_split_s": statistics.median(s[0] for _, s in runs),
                    "tokens_identical": all(c[1] == s[1] for c, s in runs), "kv_bytes": kv_bytes,
                    "kv_bytes_per_s": kv_bytes / prefill_s, "d2h_gb_per_s": gpu.get("d2h_gb_per_s"),
                    "d2h_sync_gb_per_s": gpu.get("d2h_sync_gb_per_s"), "overlap_pct": gpu.get("overlap_pct"),
                    "layer_to_host_ms": gpu.get("layer_to_host_ms"), "forward_ms": gpu.get("forward_ms"),
                    "h2d_gb_per_s": gpu.get("h2d_gb_per_s"), "h2d_sync_gb_per_s": gpu.get("h2d_sync_gb_per_s"),
                    "upload_wall_ms": gpu.get("upload_wall_ms"),
                    "links_pct_of_kv_rate": {name: 100 * rate / (kv_bytes / prefill_s) for name, rate in links.items()},
                }  # fmt: skip
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "links_pct_of_kv_rate"}), flush=True)
        except Exception as exc:  # the rows measured so far are still written
            failure = f"{type(exc).__name__}: {exc}"
            print(f"failed: {failure}", flush=True)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the stop short
            for region in regions:
                region.stop()
            if args.json:  # also after a failure or a SIGTERM: the rows measured so far
                args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"done in {time.monotonic() - began:.0f} s")
    ok = rows and len(rows) == len(args.lengths) and all(r["tokens_identical"] for r in rows) and failure is None
    raise SystemExit(0 if ok else 1)


def _terminated(_signum: int, _frame: Any) -> None:
    raise SystemExit(143)  # unwinds through `finally`: the region processes are stopped


if __name__ == "__main__":
    main()
