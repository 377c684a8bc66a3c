"""TTFT of the split path (prefill region -> KV over TCP -> decode region) beside colocated.

    python bench/split_ttft.py --json out.json [--tokens 2048] [--repeats 3] [--codec raw]

Starts two real region processes on loopback (`prfaas region`, SmolLM2-135M fp32): a
prefill region and a decode region. For the same real prompt it measures, interleaved,
median of `--repeats`:

    ttft_colocated_s        Generate on the decode region: prefill and first token in one
                            process (time to its first token event)
    ttft_split_layerwise_s  Reserve, then Prefill with each layer shipped as soon as it is
                            computed; TTFT = from the Reserve call (the split path's first
                            step, as in gpu_check.py) until the decode region, holding the
                            whole KV, streams token 0 (the decode request is sent at prefill done)
    ttft_split_whole_s      the same, shipping the whole cache after the forward

Each mode is warmed once first; within a repeat the three run in an order rotated per repeat
(`orders` records them), so that no mode always runs first or after the same one. It prints
the ratios to colocated. `--json PATH` writes prompt_tokens, the three TTFTs, the ratios, the
orders and every sample. Each call has a deadline; the regions are stopped on exit.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc

from prfaas.devstack.processes import RegionProcess, spawn_region, write_region_config
from prfaas.engine.models import prepare_model, resolve_model
from prfaas.engine.sampling import SamplingParams
from prfaas.protos.prfaas.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prfaas.region.requests import sampling_to_proto
from prfaas.transport.tickets import TicketSigner

KEY = os.urandom(32).hex()
MODEL = "smollm2-135m"
MODES = ("colocated", "layerwise", "whole")  # each repeat runs them all, in an order rotated per repeat


def start_region(folder: Path, name: str, role: str, codec: str) -> RegionProcess:
    config = {
        "name": name, "role": role, "model": MODEL, "ticket_key": KEY, "codec": codec, "kv_buffer_bytes": "2GiB",
        "listen": {"grpc": "127.0.0.1:0", "kv": "127.0.0.1:0"},
    }  # fmt: skip
    return spawn_region(write_region_config(folder / f"{name}.yaml", config), timeout_s=180)


def prompt_ids(num_tokens: int) -> list[int]:
    import argparse as text_source

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL), local_files_only=True)
    ids = list(tokenizer(inspect.getsource(text_source), add_special_tokens=False)["input_ids"])[:num_tokens]
    if len(ids) < num_tokens:
        raise SystemExit(f"the prompt source has only {len(ids)} tokens")
    return ids


def colocated(decode: decode_pb2_grpc.DecodeRegionStub, ids: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    request = decode_pb2.GenerateRequest(job_id=str(uuid.uuid4()), token_ids=ids, sampling=sampling_to_proto(params),
                                         timeout_s=300)  # fmt: skip
    for event in decode.Generate(request, timeout=300):
        if event.index == 0:
            ttft = time.perf_counter() - start
    return ttft


def split(
    prefill: prefill_pb2_grpc.PrefillRegionStub, decode: decode_pb2_grpc.DecodeRegionStub, signer: TicketSigner,
    ids: list[int], params: SamplingParams, whole: bool, codec: str,
) -> tuple[float, float, float]:  # fmt: skip
    """(TTFT, prefill compute seconds, seconds from prefill done to token 0) of one split job."""
    job_id = str(uuid.uuid4())
    kv_bytes = len(ids) * 2 * 30 * 3 * 64 * 4
    start = time.perf_counter()  # the reservation is part of the split path's TTFT
    reply = decode.Reserve(decode_pb2.ReserveRequest(job_id=job_id, attempt=1, tenant="bench", kv_bytes=kv_bytes,
                                                     ttl_s=300), timeout=10)  # fmt: skip
    ticket = signer.issue(job_id, 1, "bench", kv_bytes, ttl_s=300)
    request = prefill_pb2.PrefillRequest(
        job_id=job_id, attempt=1, tenant="bench", token_ids=ids, sampling=sampling_to_proto(params), timeout_s=300,
        destination=prefill_pb2.Destination(kv_endpoint=reply.kv_endpoint, ticket=ticket, codec=codec),
        ship_whole=whole,
    )  # fmt: skip
    prefill_s, done_at = 0.0, 0.0
    result: list[float] = []

    def run_decode(done: prefill_pb2.PrefillDone) -> None:
        call = decode_pb2.DecodeRequest(job_id=job_id, attempt=1, first_token=done.first_token, kv=done.kv,
                                        sampling=sampling_to_proto(params), timeout_s=300)  # fmt: skip
        for event in decode.Decode(call, timeout=300):
            if event.index == 0:
                result.append(time.perf_counter() - start)

    decoder = None
    for event in prefill.Prefill(request, timeout=300):
        if event.HasField("prefill_done"):
            prefill_s = event.prefill_done.prefill_s
            done_at = time.perf_counter() - start
            decoder = threading.Thread(target=run_decode, args=(event.prefill_done,))
            decoder.start()
    assert decoder is not None
    decoder.join(300)
    return result[0], prefill_s, result[0] - done_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--codec", default="raw", choices=["raw", "lossless", "fp8", "int8"])
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    prepare_model(MODEL)
    ids = prompt_ids(args.tokens)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    signer = TicketSigner({"k1": KEY.encode()}, "k1")
    with tempfile.TemporaryDirectory() as tmp:
        regions: list[RegionProcess] = []
        orders: list[list[str]] = []  # each repeat's order of the modes
        try:
            regions.append(start_region(Path(tmp), "bench-prefill", "prefill", args.codec))
            regions.append(start_region(Path(tmp), "bench-decode", "decode", args.codec))
            prefill = prefill_pb2_grpc.PrefillRegionStub(grpc.insecure_channel(regions[0].grpc))
            decode = decode_pb2_grpc.DecodeRegionStub(grpc.insecure_channel(regions[1].grpc))
            # warm every mode once: both engines, the channel and the receiver's buffers of each shipping mode
            colocated(decode, ids[:64], params)
            for whole in (False, True):
                split(prefill, decode, signer, ids[:64], params, whole, args.codec)
            samples: dict[str, list[float]] = {
                key: []
                for key in (
                    "colocated",
                    "layerwise",
                    "whole",
                    "prefill_s",
                    "whole_prefill_s",
                    "tail_layerwise",
                    "tail_whole",
                )
            }
            for i in range(args.repeats):
                order = MODES[i % len(MODES) :] + MODES[: i % len(MODES)]
                orders.append(list(order))
                for mode in order:
                    if mode == "colocated":
                        samples["colocated"].append(colocated(decode, ids, params))
                        continue
                    ttft, prefill_s, tail = split(prefill, decode, signer, ids, params, mode == "whole", args.codec)
                    samples[mode].append(ttft)
                    samples["prefill_s" if mode == "layerwise" else "whole_prefill_s"].append(prefill_s)
                    samples[f"tail_{mode}"].append(tail)
                print(f"colocated {samples['colocated'][-1]:.3f} s  layerwise {samples['layerwise'][-1]:.3f} s  "
                      f"whole {samples['whole'][-1]:.3f} s  (order {', '.join(order)})", flush=True)  # fmt: skip
        finally:
            for region in regions:
                region.stop()
    med = {key: statistics.median(values) for key, values in samples.items()}
    figures = {
        "prompt_tokens": args.tokens, "codec": args.codec, "repeats": args.repeats,
        "ttft_colocated_s": med["colocated"], "ttft_split_layerwise_s": med["layerwise"],
        "ttft_split_whole_s": med["whole"], "prefill_compute_layerwise_s": med["prefill_s"],
        "prefill_compute_whole_s": med["whole_prefill_s"], "tail_after_prefill_layerwise_s": med["tail_layerwise"],
        "tail_after_prefill_whole_s": med["tail_whole"],
        "layerwise_over_colocated": med["layerwise"] / med["colocated"],
        "whole_over_colocated": med["whole"] / med["colocated"], "samples": samples, "orders": orders,
        "kv_bytes": args.tokens * 2 * 30 * 3 * 64 * 4, "cpus": os.cpu_count(),
    }  # fmt: skip
    print(f"prompt {args.tokens} tokens, codec {args.codec}, median of {args.repeats}:")
    print(f"  colocated TTFT          {med['colocated']:.3f} s")
    print(f"  split, layer-wise TTFT  {med['layerwise']:.3f} s  ({figures['layerwise_over_colocated']:.3f}x colocated)")
    print(f"  split, whole-cache TTFT {med['whole']:.3f} s  ({figures['whole_over_colocated']:.3f}x colocated)")
    print(f"  after prefill done: token 0 {1e3 * med['tail_layerwise']:.0f} ms later (layer-wise), "
          f"{1e3 * med['tail_whole']:.0f} ms (whole); prefill compute {med['prefill_s']:.3f} s (layer-wise), "
          f"{med['whole_prefill_s']:.3f} s (whole)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
