"""Compression ratio and speed of KV codecs on real SmolLM2 KV, side by side in one run.

    .venv/bin/python -m prfaas.bench.codec_ratio [--tokens 2048] [--repeat 5] [--only NAME,...] [--json PATH]

Prefills SmolLM2-135M on the source of argparse in bfloat16 and float32, then runs every
layer's K and V ([kv_heads, tokens, head_dim], one tensor a call, as the sender does)
through each candidate lossless stage and the transport's codecs (whose sizes include
their header and scales). Speeds are MB of raw KV per second on one core (torch and
blosc2 limited to one thread), best of `--repeat` rounds; then the lossless codec's
aggregate encode speed with one and two concurrent sender threads. Keys carry the model's query
energy (`prfaas model calibrate`), as a calibrated prefill region ships them: kvw6 and kvw4
shape their key steps by it (the bench says so when the model is not calibrated). `--only`
keeps the candidates whose name contains one of the given strings. zipnn is measured
where it is installed (it is not a dependency). A lossless candidate that does not
roundtrip bit for bit, or that writes into its input, is flagged.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from prfaas.transport.codecs import CODEC_NAMES, TensorMeta, get_codec

Encode = Callable[[bytes, TensorMeta], Any]
Decode = Callable[[Any, TensorMeta], bytes]


@dataclass
class Row:
    dtype: str
    name: str
    ratio: float  # raw bytes / encoded bytes, over all tensors
    encode_mb_s: float  # MB (1e6 bytes) of raw KV per second, one core
    decode_mb_s: float
    exact: bool
    note: str = ""


LOSSY_STAGES = tuple(f"codec {name}" for name in CODEC_NAMES if not get_codec(name).lossless)


def real_kv(dtype: str, num_tokens: int) -> list[tuple[bytes, TensorMeta]]:
    from prfaas.engine.hf import HFEngine  # transformers: seconds to import, after the arguments are checked
    from prfaas.engine.sampling import SamplingParams

    engine = HFEngine("smollm2-135m", dtype=dtype)
    ids = engine.encode(inspect.getsource(argparse))[:num_tokens]
    kv = engine.prefill(ids, SamplingParams(max_new_tokens=1)).kv
    energy = engine.query_energy
    if energy is None:
        print("smollm2-135m is not calibrated (prfaas model calibrate): kvw6 and kvw4 keys by range alone")
    return [
        (
            t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
            TensorMeta(dtype, tuple(t.shape), part, energy[index] if energy is not None and part == 0 else None),
        )
        for index, layer in enumerate(kv.layers)
        for part, t in enumerate((layer.k, layer.v))
    ]


def byte_planes_zstd(level: int) -> tuple[Encode, Decode]:
    """Hand-rolled: one zstd frame per byte plane (bf16: lo, hi; fp32: 4 planes)."""

    def encode(data: bytes, meta: TensorMeta) -> list[bytes]:
        itemsize = 4 if meta.dtype == "float32" else 2
        planes = np.frombuffer(data, np.uint8).reshape(-1, itemsize).T
        compressor = zstandard.ZstdCompressor(level=level)
        return [compressor.compress(np.ascontiguousarray(plane).data) for plane in planes]

    def decode(frames: list[bytes], meta: TensorMeta) -> bytes:
        decompressor = zstandard.ZstdDecompressor()
        planes = [np.frombuffer(decompressor.decompress(frame), np.uint8) for frame in frames]
        return np.stack(planes, axis=1).tobytes()

    return encode, decode


def plain_zstd(level: int) -> tuple[Encode, Decode]:
    def encode(data: bytes, meta: TensorMeta) -> bytes:
        return zstandard.ZstdCompressor(level=level).compress(data)

    def decode(frame: bytes, meta: TensorMeta) -> bytes:
        return zstandard.ZstdDecompressor().decompress(frame)

    return encode, decode


def blosc2_stage(filter_name: str, clevel: int) -> tuple[Encode, Decode]:
    blosc2: Any = importlib.import_module("blosc2")

    def encode(data: bytes, meta: TensorMeta) -> bytes:
        typesize = 4 if meta.dtype == "float32" else 2
        return bytes(
            blosc2.compress2(
                data,
                codec=blosc2.Codec.ZSTD,
                clevel=clevel,
                filters=[getattr(blosc2.Filter, filter_name)],
                typesize=typesize,
                nthreads=1,
            )
        )

    def decode(chunk: bytes, meta: TensorMeta) -> bytes:
        return bytes(blosc2.decompress2(chunk, nthreads=1))

    return encode, decode


def zipnn_stage() -> tuple[Encode, Decode]:
    zipnn: Any = importlib.import_module("zipnn")  # ImportError: reported as a note
    by_dtype = {
        d: zipnn.ZipNN(method="zstd", bytearray_dtype=d, threads=1, zstd_level=1) for d in ("bfloat16", "float32")
    }

    def encode(data: bytes, meta: TensorMeta) -> bytes:
        return bytes(by_dtype[meta.dtype].compress(data))

    def decode(blob: bytes, meta: TensorMeta) -> bytes:
        return bytes(by_dtype[meta.dtype].decompress(blob))

    return encode, decode


def codec_stage(name: str) -> tuple[Encode, Decode]:
    codec = get_codec(name)
    return codec.encode, codec.decode


def encoded_size(blob: Any) -> int:
    return sum(len(part) for part in blob) if isinstance(blob, list) else len(blob)


@dataclass
class Timing:
    stage: tuple[Encode, Decode] | None  # None: the candidate could not be set up (see error)
    encode_s: float = float("inf")  # best over the rounds
    decode_s: float = float("inf")
    encoded_bytes: int = 0
    exact: bool = True
    mutated: bool = False
    error: str = ""


def run_round(timing: Timing, tensors: list[tuple[bytes, TensorMeta]]) -> None:
    assert timing.stage is not None
    encode, decode = timing.stage
    # Fresh copies, untimed: zipnn 0.5.4 rewrites the buffer it compresses, even an immutable bytes.
    inputs = [bytes(bytearray(data)) for data, _ in tensors]
    start = time.perf_counter()
    blobs = [encode(data, meta) for data, (_, meta) in zip(inputs, tensors, strict=True)]
    timing.encode_s = min(timing.encode_s, time.perf_counter() - start)
    start = time.perf_counter()
    decoded = [decode(blob, meta) for blob, (_, meta) in zip(blobs, tensors, strict=True)]
    timing.decode_s = min(timing.decode_s, time.perf_counter() - start)
    timing.encoded_bytes = sum(encoded_size(blob) for blob in blobs)
    timing.exact &= all(out == data for out, (data, _) in zip(decoded, tensors, strict=True))
    timing.mutated |= any(copy != data for copy, (data, _) in zip(inputs, tensors, strict=True))


def measure(dtype: str, tensors: list[tuple[bytes, TensorMeta]], repeat: int, only: list[str]) -> list[Row]:
    """One row per candidate. Rounds go over all candidates in turn, so a burst of load from
    elsewhere on the machine slows one round of every candidate rather than all of one."""
    timings: dict[str, Timing] = {}
    for name, make in candidates():
        if only and not any(part in name for part in only):
            continue
        try:
            timings[name] = Timing(make())
        except Exception as exc:  # a candidate library that is not installed
            timings[name] = Timing(None, error=f"{type(exc).__name__}: {exc}")
    for _ in range(repeat):
        for timing in timings.values():
            if timing.error:
                continue
            try:
                run_round(timing, tensors)
            except Exception as exc:  # a candidate that fails on real data
                timing.error = f"{type(exc).__name__}: {exc}"
    raw_bytes = sum(len(data) for data, _ in tensors)
    rows = []
    for name, t in timings.items():
        if t.error:
            rows.append(Row(dtype, name, 0.0, 0.0, 0.0, False, t.error))
            continue
        notes = []
        if not t.exact and name not in LOSSY_STAGES:
            notes.append("roundtrip MISMATCH: decoded bytes differ from the input")
        if t.mutated:
            notes.append("MUTATES its input buffer in place (decodes to the original)")
        ratio = raw_bytes / t.encoded_bytes
        speeds = raw_bytes / t.encode_s / 1e6, raw_bytes / t.decode_s / 1e6
        rows.append(Row(dtype, name, ratio, *speeds, t.exact, "; ".join(notes)))
    return rows


def concurrent_encode_mb_s(name: str, tensors: list[tuple[bytes, TensorMeta]], num_threads: int, repeat: int) -> float:
    """Aggregate encode MB/s of `num_threads` senders each encoding every tensor, best of `repeat`."""
    codec = get_codec(name)
    best_s = float("inf")
    for _ in range(repeat):
        threads = [
            threading.Thread(target=lambda: [codec.encode(data, meta) for data, meta in tensors])
            for _ in range(num_threads)
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best_s = min(best_s, time.perf_counter() - start)
    return num_threads * sum(len(data) for data, _ in tensors) / best_s / 1e6


def candidates() -> list[tuple[str, Callable[[], tuple[Encode, Decode]]]]:
    stages: list[tuple[str, Callable[[], tuple[Encode, Decode]]]] = [
        ("zstd-1 (plain)", functools.partial(plain_zstd, 1)),
        ("byte planes + zstd-1", functools.partial(byte_planes_zstd, 1)),
    ]
    for filter_name in ("SHUFFLE", "BITSHUFFLE"):
        for clevel in (1, 2, 3):
            name = f"blosc2 {filter_name.lower()} + zstd-{clevel}"
            stages.append((name, functools.partial(blosc2_stage, filter_name, clevel)))
    stages.append(("zipnn zstd-1", zipnn_stage))
    stages += [(f"codec {name}", functools.partial(codec_stage, name)) for name in CODEC_NAMES]
    return stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens to prefill (default 2048)")
    parser.add_argument("--repeat", type=int, default=5, help="timing rounds, best kept (default 5)")
    parser.add_argument("--only", default="", help="comma-separated: candidates whose name contains one")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    for flag, value in (("--tokens", args.tokens), ("--repeat", args.repeat)):
        if value < 1:
            parser.error(f"{flag} {value}: at least 1")  # before the model loads
    only = [part for part in args.only.split(",") if part]
    torch.set_num_threads(1)

    rows: list[Row] = []
    scaling: dict[str, float] = {}
    for dtype in ("bfloat16", "float32"):
        tensors = real_kv(dtype, args.tokens)
        meta = tensors[0][1]
        print(f"\n{dtype}: {len(tensors)} tensors of shape {list(meta.shape)}, {meta.nbytes} bytes each", flush=True)
        for row in measure(dtype, tensors, args.repeat, only):
            rows.append(row)
            print(
                f"  {row.name:28s} ratio {row.ratio:5.3f}  encode {row.encode_mb_s:6.0f} MB/s  "
                f"decode {row.decode_mb_s:6.0f} MB/s  {row.note}",
                flush=True,
            )
        for num_threads in (1, 2):
            key = f"{dtype} lossless encode, {num_threads} threads"
            scaling[key] = concurrent_encode_mb_s("lossless", tensors, num_threads, args.repeat)
            print(f"  {key}: {scaling[key]:.0f} MB/s aggregate", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "rows": [asdict(r) for r in rows], "concurrent": scaling}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
