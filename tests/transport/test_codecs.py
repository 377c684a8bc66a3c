"""KV codecs: exact roundtrips, lossy error bounds, and CodecError for every bad payload."""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.transport.codecs import CODEC_NAMES, Codec, CodecId, TensorMeta, _compress, _pack, get_codec
from prfaas.transport.errors import CodecError

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Half an ulp of each dtype's mantissa: the error of rounding a float32 into it.
ROUNDING = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
LOSSY = ("fp8", "int8", "kv8", "kv6", "kv4", "kvw6", "kvw4")
Bound = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]  # (x, y, dtype) -> allowed |y - x|

dtypes = st.sampled_from(sorted(TORCH))
shapes = st.tuples(st.integers(0, 4), st.integers(0, 33), st.integers(0, 17))


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes, meta: TensorMeta) -> torch.Tensor:
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=TORCH[meta.dtype])
    return torch.frombuffer(bytearray(data), dtype=TORCH[meta.dtype]).view(meta.shape)


def kv_like(shape: tuple[int, int, int], dtype: str, seed: int, decades: float = 3) -> torch.Tensor:
    """Normal values whose magnitude varies per head and per channel over 10**±decades,
    like keys with outlier channels; at 3 small heads reach e4m3's subnormal range."""
    g = torch.Generator().manual_seed(seed)
    heads, _, head_dim = shape
    magnitude = 10 ** torch.empty(heads, 1, head_dim).uniform_(-decades, decades, generator=g)
    return (torch.randn(shape, generator=g) * magnitude).to(TORCH[dtype])


@functools.cache
def payload(name: str = "lossless", dtype: str = "bfloat16", shape: tuple[int, int, int] = (2, 8, 4)) -> bytes:
    meta = TensorMeta(dtype, shape)
    return get_codec(name).encode(tensor_bytes(kv_like(shape, dtype, seed=1)), meta)


@pytest.mark.parametrize("name", ["raw", "lossless"])
@settings(max_examples=60, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_lossless_codecs_return_every_bit_pattern(name: str, dtype: str, shape: tuple[int, ...], seed: int) -> None:
    # Arbitrary bytes: NaN payloads, infinities, -0.0 and subnormals must all come back.
    meta = TensorMeta(dtype, shape)
    data = np.random.default_rng(seed).integers(0, 256, meta.nbytes, dtype=np.uint8).tobytes()
    codec = get_codec(name)
    assert codec.decode(codec.encode(data, meta), meta) == data
    assert codec.decode(codec.encode(memoryview(data), meta), meta) == data


def test_lossless_compresses_smooth_bf16_data() -> None:
    # bf16 KV compresses through its exponent bytes: 1.47x on SmolLM2 (docs/benchmarks.md),
    # ~1.40x on normal values with channel magnitudes within 10**±1.
    shape = (4, 512, 64)
    data = tensor_bytes(kv_like(shape, "bfloat16", seed=3, decades=1))
    encoded = get_codec("lossless").encode(data, TensorMeta("bfloat16", shape))
    assert len(data) / len(encoded) > 1.3


def fp8_bound(x: torch.Tensor, y: torch.Tensor, dtype: str) -> torch.Tensor:
    """The error e4m3 with one scale per head allows (x, y in float64)."""
    scale = x.abs().amax(dim=(1, 2), keepdim=True) / 448
    # e4m3 keeps 3 mantissa bits (relative error <= 2**-4) above its smallest normal, 2**-6 * scale;
    # below it steps are 2**-9 * scale. Then the float32 result is rounded into dtype.
    return 2.0**-4 * x.abs() + 2.0**-10 * scale + ROUNDING[dtype] * y.abs() + 2.0**-24


def int8_bound(x: torch.Tensor, y: torch.Tensor, dtype: str) -> torch.Tensor:
    """Half a step of int8 with one scale per (head, channel), then rounding into dtype."""
    scale = x.abs().amax(dim=1, keepdim=True) / 127  # per (head, channel)
    return scale / 2 + ROUNDING[dtype] * y.abs() + 2.0**-24


def assert_round_trip_within(name: str, bound: Bound, dtype: str, shape: tuple[int, int, int], seed: int) -> None:
    """Codec `name` gives KV-like values back with their dtype and shape, each value within
    `bound` of the original (+0.1 % for the float64 arithmetic of the bound itself)."""
    meta = TensorMeta(dtype, shape)
    x = kv_like(shape, dtype, seed)
    codec = get_codec(name)
    y = from_bytes(codec.decode(codec.encode(tensor_bytes(x), meta), meta), meta)
    assert y.dtype == x.dtype and y.shape == x.shape
    if x.numel() == 0:
        return
    x64, y64 = x.double(), y.double()
    assert bool(((y64 - x64).abs() <= bound(x64, y64, dtype) * 1.001).all())


@settings(max_examples=40, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_fp8_error_is_within_e4m3_precision_per_head(dtype: str, shape: tuple[int, int, int], seed: int) -> None:
    assert_round_trip_within("fp8", fp8_bound, dtype, shape, seed)


@settings(max_examples=40, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_int8_error_is_within_half_a_channel_scale(dtype: str, shape: tuple[int, int, int], seed: int) -> None:
    assert_round_trip_within("int8", int8_bound, dtype, shape, seed)


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("part", [0, 1])  # keys and values: the kv codecs code them apart
def test_lossy_codecs_keep_zeros_and_all_zero_heads(name: str, part: int) -> None:
    x = torch.zeros(3, 5, 8, dtype=torch.bfloat16)
    x[1] = torch.linspace(-2, 2, 40).view(5, 8)
    meta = TensorMeta("bfloat16", (3, 5, 8), part)
    codec = get_codec(name)
    y = from_bytes(codec.decode(codec.encode(tensor_bytes(x), meta), meta), meta)
    assert torch.equal(y[0], x[0]) and torch.equal(y[2], x[2])


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("part", [0, 1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_lossy_codecs_refuse_non_finite_values(name: str, part: int, bad: float) -> None:
    x = torch.ones(2, 3, 4)
    x[1, 2, 3] = bad
    with pytest.raises(CodecError, match="NaN or infinity"):
        get_codec(name).encode(tensor_bytes(x), TensorMeta("float32", (2, 3, 4), part))


def near_the_largest(dtype: str) -> list[tuple[str, torch.Tensor]]:
    """Finite tensors at (and near) the dtype's largest value: a rounded-up scale, a key mean or a rotation
    carries them past it (or past float32's range) unless the codec takes care."""
    big = torch.finfo(TORCH[dtype]).max
    return [
        ("max and -max", torch.tensor([[[big], [-big]]])),
        ("a channel beside zeros", torch.tensor([[[big, 0.0], [-big, 0.0]]])),
        ("one token", torch.tensor([[[big]]])),
        ("a channel summing past the range", torch.full((1, 4, 1), big)),
        ("a spread past the range", torch.tensor([[[big], [big], [big], [-big]]])),
        ("a token rotating past the range", torch.full((1, 2, 4), big)),
        ("just below the largest", torch.tensor([[[big * 0.999], [-big * 0.999]]])),
    ]


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("part", [0, 1])
@pytest.mark.parametrize("dtype", sorted(TORCH))
def test_lossy_codecs_keep_values_near_the_dtypes_largest_finite_and_close(name: str, part: int, dtype: str) -> None:
    for what, x in near_the_largest(dtype):
        x = x.to(TORCH[dtype])
        meta = TensorMeta(dtype, tuple(x.shape), part)
        codec = get_codec(name)
        y = from_bytes(codec.decode(codec.encode(tensor_bytes(x), meta), meta), meta).double()
        assert bool(torch.isfinite(y).all()), (what, y)
        # kv4's half step of a spread of 1.5 x max, rotated: within 0.2 x max
        assert bool(((y - x.double()).abs() <= 0.2 * torch.finfo(TORCH[dtype]).max).all()), (what, y)


def forged_fp8(meta: TensorMeta, scales: list[float], codes: bytes) -> bytes:
    """A well-formed fp8 payload (header, checksum) of any scales and code bytes: what a peer can send."""
    return _pack(CodecId.FP8, meta, np.array(scales, dtype="<f4").tobytes(), _compress(codes, 1))


@pytest.mark.parametrize("nan_code", [0x7F, 0xFF])  # e4m3fn's NaNs: +NaN and -NaN
def test_fp8_payload_with_a_nan_code_byte_is_refused(nan_code: int) -> None:
    meta = TensorMeta("float16", (2, 4, 8))
    codes = bytearray([0x10] * 64)  # 0x10 = 2**-5, finite
    codes[37] = nan_code
    with pytest.raises(CodecError, match="NaN code"):
        get_codec("fp8").decode(forged_fp8(meta, [1.0, 1.0], bytes(codes)), meta)


@pytest.mark.parametrize("dtype", sorted(TORCH))
def test_fp8_forged_scale_decodes_within_the_dtypes_finite_range(dtype: str) -> None:
    # A finite scale whose 448 x scale is past the dtype's largest (float32: past float32's own range, so the
    # product is inf before any cast): clamped, as int8 and the kv codecs clamp.
    big = torch.finfo(TORCH[dtype]).max
    meta = TensorMeta(dtype, (2, 4, 8))
    codes = bytes([0x7E] * 32 + [0xFE] * 32)  # +448 in head 0, -448 in head 1
    y = from_bytes(get_codec("fp8").decode(forged_fp8(meta, [big, big], codes), meta), meta).double()
    assert y[0].eq(big).all() and y[1].eq(-big).all(), y


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_codecs_need_a_three_dimensional_shape(name: str) -> None:
    with pytest.raises(CodecError, match="num_kv_heads"):
        get_codec(name).encode(bytes(16), TensorMeta("float32", (4,)))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encode_refuses_data_of_the_wrong_size(name: str) -> None:
    with pytest.raises(CodecError, match="got 10 bytes"):
        get_codec(name).encode(bytes(10), TensorMeta("float16", (1, 2, 3)))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_truncation_raises_codec_error(name: str) -> None:
    good = payload(name)
    meta = TensorMeta("bfloat16", (2, 8, 4))
    for end in range(len(good)):
        with pytest.raises(CodecError):
            get_codec(name).decode(good[:end], meta)


@pytest.mark.parametrize("name", ["lossless", "fp8", "int8"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_altered_byte_raises_codec_error(name: str, data: st.DataObject) -> None:
    # The header is checked field by field and the rest by its checksum: no altered payload
    # decodes to wrong values (RAW has no header; the frame checksum covers it).
    good = bytearray(payload(name))
    index = data.draw(st.integers(0, len(good) - 1))
    good[index] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CodecError):
        get_codec(name).decode(bytes(good), TensorMeta("bfloat16", (2, 8, 4)))


@pytest.mark.parametrize("name", CODEC_NAMES)
@settings(max_examples=150, deadline=None)
@given(junk=st.binary(max_size=300) | st.binary(min_size=24, max_size=300).map(lambda b: b"PFKC\x01" + b[5:]))
def test_arbitrary_bytes_decode_to_codec_error_or_the_right_size(name: str, junk: bytes) -> None:
    meta = TensorMeta("bfloat16", (2, 8, 4))
    try:
        out = get_codec(name).decode(junk, meta)
    except CodecError:
        return
    assert len(out) == meta.nbytes


@pytest.mark.parametrize("name", ["lossless", "fp8", "int8"])
@pytest.mark.parametrize(
    "meta",
    [TensorMeta("float16", (2, 8, 4)), TensorMeta("bfloat16", (2, 8, 5))],
    ids=["same-size-other-dtype", "other-size"],
)
def test_payload_decoded_with_another_meta_raises(name: str, meta: TensorMeta) -> None:
    with pytest.raises(CodecError, match="meta expects"):
        get_codec(name).decode(payload(name), meta)


def test_payload_of_another_codec_is_refused() -> None:
    with pytest.raises(CodecError, match="encoded by codec id 2"):
        get_codec("int8").decode(payload("fp8"), TensorMeta("bfloat16", (2, 8, 4)))


def test_payload_of_another_version_names_both_versions() -> None:
    bad = bytearray(payload())
    bad[4] = 9
    with pytest.raises(CodecError, match="version 9; this build reads version 1"):
        get_codec("lossless").decode(bytes(bad), TensorMeta("bfloat16", (2, 8, 4)))


def test_header_claiming_a_huge_size_is_refused_before_allocating() -> None:
    bad = bytearray(payload())
    struct.pack_into("<Q", bad, 8, 2**62)
    with pytest.raises(CodecError, match="meta expects"):
        get_codec("lossless").decode(bytes(bad), TensorMeta("bfloat16", (2, 8, 4)))


def test_unknown_codec_names_the_known_ones() -> None:
    with pytest.raises(
        CodecError, match=r"unknown codec 'zip'; known: raw \(0\), lossless \(1\), fp8 \(2\), int8 \(3\)"
    ):
        get_codec("zip")
    with pytest.raises(CodecError, match="unknown codec 9"):
        get_codec(9)


def test_codec_ids_and_names_are_the_wire_values() -> None:
    assert [int(c) for c in CodecId] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert CODEC_NAMES == ("raw", "lossless", "fp8", "int8", "kv8", "kv6", "kv4", "kvw6", "kvw4")
    for codec_id, name in zip(CodecId, CODEC_NAMES, strict=True):
        codec: Codec = get_codec(name)
        assert get_codec(codec_id) is codec and get_codec(int(codec_id)) is codec
        assert (codec.codec_id, codec.name, codec.lossless) == (codec_id, name, name in ("raw", "lossless"))


def test_meta_refuses_unknown_dtypes_and_negative_dims() -> None:
    with pytest.raises(CodecError, match="unsupported dtype 'int4'"):
        TensorMeta("int4", (1, 1, 1))
    with pytest.raises(CodecError, match="non-negative"):
        TensorMeta("float32", (1, -1, 1))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_concurrent_encodes_match_serial_ones(name: str) -> None:
    meta = TensorMeta("bfloat16", (3, 256, 64))
    inputs = [tensor_bytes(kv_like((3, 256, 64), "bfloat16", seed)) for seed in range(8)]
    codec = get_codec(name)
    expected = [codec.encode(data, meta) for data in inputs]
    results: list[bytes | None] = [None] * len(inputs)

    def work(i: int) -> None:
        for _ in range(5):
            results[i] = codec.decode(codec.encode(inputs[i], meta), meta)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [codec.decode(p, meta) for p in expected]
