"""The key- and value-aware codecs (kv8, kv6, kv4, kvw6, kvw4): every key within half a step of its channel
group's scale, every value token within the rotated step's bound, on random and on real KV; zeros stay
a payload for the other part and an old peer's unknown codec id are refused (zeros and non-finite input:
test_codecs.py, with every lossy codec)."""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codecs import ROUNDING, TORCH, from_bytes, kv_like, tensor_bytes
from transport_kit import Kit

from prfaas.engine.hf import HFEngine
from prfaas.engine.sampling import SamplingParams
from prfaas.transport.codecs import CodecId, KVQuantizedCodec, TensorMeta, get_codec
from prfaas.transport.errors import CodecError, FrameError
from prfaas.transport.kvquant import KV_QUANTIZERS, KVQuantizer, hadamard
from prfaas.transport.open_info import OpenInfo

KV_CODECS = tuple(KV_QUANTIZERS)
dtypes = st.sampled_from(sorted(TORCH))
shapes = st.tuples(st.integers(0, 3), st.integers(0, 70), st.sampled_from([0, 1, 3, 8, 16]))


def round_trip(name: str, x: torch.Tensor, dtype: str, part: int) -> torch.Tensor:
    meta = TensorMeta(dtype, tuple(x.shape), part)
    codec = get_codec(name)
    y = from_bytes(codec.decode(codec.encode(tensor_bytes(x), meta), meta), meta)
    assert y.dtype == x.dtype and y.shape == x.shape
    return y


def assert_keys_within_bound(name: str, x: torch.Tensor, y: torch.Tensor, dtype: str) -> None:
    """Centred by the channel mean, quantized with a bf16 scale per (head, token group, channel):
    half a step, or what the bf16 rounding of the scale clamps (amax * 2**-8), plus rounding into dtype."""
    q = KV_QUANTIZERS[name]
    x64, y64 = x.double(), y.double()
    centred = x64 - x64.mean(dim=1, keepdim=True)
    tokens = x.shape[1]
    size = q.k_group or max(1, tokens)
    groups = [centred[:, i : i + size] for i in range(0, tokens, size)]
    amax = torch.cat([g.abs().amax(dim=1, keepdim=True).expand_as(g) for g in groups], dim=1)
    step = amax / q.unweighted_level  # without query weights: by range alone
    bound = step * 0.5 + amax * 2.0**-8 + ROUNDING[dtype] * y64.abs() + 1e-6 * (x64.abs() + amax) + 2e-24
    assert bool(((y64 - x64).abs() <= bound * 1.01).all())


def assert_values_within_bound(name: str, x: torch.Tensor, y: torch.Tensor, dtype: str) -> None:
    """Rotated (head_dim a power of two), quantized with a bf16 scale per token: each token's error norm
    within sqrt(head_dim) x (half a step + the scale's clamp), the rotation keeping norms, plus rounding."""
    q = KV_QUANTIZERS[name]
    x64, y64 = x.double(), y.double()
    head_dim = x.shape[2]
    rotated = x64 @ hadamard(head_dim).double() if head_dim > 1 and head_dim & (head_dim - 1) == 0 else x64
    amax = rotated.abs().amax(dim=2)
    err = (y64 - x64).norm(dim=2)
    bound = math.sqrt(head_dim) * (amax / q.v_qmax * 0.5 + amax * 2.0**-8) + ROUNDING[dtype] * y64.norm(dim=2) * 2
    assert bool((err <= bound * 1.01 + 1e-6 * x64.norm(dim=2) + 2e-24).all())


@pytest.mark.parametrize(
    ("part", "assert_within_bound"),
    [
        pytest.param(0, assert_keys_within_bound, id="keys"),
        pytest.param(1, assert_values_within_bound, id="values"),
    ],
)
@pytest.mark.parametrize("name", KV_CODECS)
@settings(max_examples=30, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_keys_and_values_come_back_within_their_bounds(
    part: int,
    assert_within_bound: Callable[[str, torch.Tensor, torch.Tensor, str], None],
    name: str,
    dtype: str,
    shape: tuple[int, int, int],
    seed: int,
) -> None:
    """Keys within half a channel step, values within the rotated token step (the bounds above)."""
    x = kv_like(shape, dtype, seed, decades=2)
    y = round_trip(name, x, dtype, part)
    if x.numel():
        assert_within_bound(name, x, y, dtype)


@pytest.fixture(scope="module")
def real_kv(tiny_engine: HFEngine, long_text: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = tiny_engine.encode(long_text)[2000:2300]
    kv = tiny_engine.prefill(ids, SamplingParams(max_new_tokens=1)).kv
    return [(layer.k, layer.v) for layer in kv.layers]


@pytest.mark.parametrize("name", KV_CODECS)
def test_real_kv_comes_back_within_the_bounds_and_compresses(
    name: str, real_kv: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    raw = wire = 0
    for k, v in real_kv:
        for part, t in ((0, k), (1, v)):
            bf16 = t.to(torch.bfloat16)
            meta = TensorMeta("bfloat16", tuple(t.shape), part)
            raw += meta.nbytes
            wire += len(get_codec(name).encode(tensor_bytes(bf16), meta))
        assert_keys_within_bound(name, k, round_trip(name, k, "float32", 0), "float32")
        assert_values_within_bound(name, v, round_trip(name, v, "float32", 1), "float32")
    floor = {"kv8": 1.9, "kv6": 2.2, "kv4": 3.5, "kvw6": 2.2, "kvw4": 3.5}[name]  # SmolLM2: 2.2, 2.55, 4.2
    assert raw / wire > floor


def test_a_key_payload_does_not_decode_as_values() -> None:
    x = kv_like((2, 40, 8), "float32", seed=5)
    codec = get_codec("kv8")
    payload = codec.encode(tensor_bytes(x), TensorMeta("float32", (2, 40, 8), 0))
    with pytest.raises(CodecError):  # another side-data size: the checksum or the layout does not fit
        codec.decode(payload, TensorMeta("float32", (2, 40, 8), 1))


@pytest.mark.parametrize("name", KV_CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_key_payload_with_a_mean_that_is_not_finite_is_refused(name: str, bad: float) -> None:
    # The checksum (xxh3, no MAC) is recomputed: the decoder itself must refuse the mean, as it refuses scales.
    meta = TensorMeta("bfloat16", (1, 4, 8), 0)
    payload = bytearray(get_codec(name).encode(tensor_bytes(kv_like((1, 4, 8), "bfloat16", seed=3)), meta))
    struct.pack_into("<f", payload, 24 + 4 * 5, bad)  # the sixth channel's mean
    struct.pack_into("<Q", payload, 16, xxhash.xxh3_64_intdigest(bytes(payload[24:])))
    with pytest.raises(CodecError, match="mean"):
        get_codec(name).decode(bytes(payload), meta)


def test_an_old_peer_refuses_a_shipment_in_a_codec_id_it_does_not_know() -> None:
    assert [int(c) for c in (CodecId.KV8, CodecId.KV6, CodecId.KV4, CodecId.KVW6, CodecId.KVW4)] == [4, 5, 6, 7, 8]
    opened = {"ticket": "t", "num_layers": 1, "dtype": "bfloat16", "layer_shapes": [[1, 2, 8]], "codec": 99,
              "chunk_bytes": 4096}  # fmt: skip
    with pytest.raises(FrameError, match="codec"):
        OpenInfo.from_json(opened)


# -- query-weighted key scales (encoder only: the same payload layout, the same decoder) ----------------


def key_steps(payload: bytes, shape: tuple[int, int, int], groups: int) -> torch.Tensor:
    """The bf16 key scales [heads, groups, 1, head_dim] a payload carries (docs/wire-format.md: a
    24-byte header, float32 means per (head, channel), then the scales)."""
    heads, _, head_dim = shape
    start = 24 + heads * head_dim * 4
    raw = torch.frombuffer(bytearray(payload[start : start + heads * groups * head_dim * 2]), dtype=torch.bfloat16)
    return raw.float().view(heads, groups, 1, head_dim)


WEIGHTED = {name: q for name, q in KV_QUANTIZERS.items() if q.weighted}  # kvw6, kvw4
PLAIN = {"kvw6": "kv6", "kvw4": "kv4"}  # what each weighted codec's keys are without weights


def weighted_codec(name: str) -> KVQuantizedCodec:
    return KVQuantizedCodec(CodecId.KV8, name, WEIGHTED[name]) if name not in KV_QUANTIZERS else get_codec(name)


def test_the_weighted_wire_codecs_are_the_measured_points() -> None:
    """kvw6 and kvw4 are kvqw-127-45-31 and kvqw-127-5-7-64 of docs/benchmarks.md."""
    assert set(WEIGHTED) == {"kvw6", "kvw4"}
    assert (WEIGHTED["kvw6"].k_qmax, WEIGHTED["kvw6"].level, WEIGHTED["kvw6"].v_qmax) == (127, 45, 31)
    assert (WEIGHTED["kvw4"].k_qmax, WEIGHTED["kvw4"].level, WEIGHTED["kvw4"].v_qmax) == (127, 5, 7)
    assert WEIGHTED["kvw4"].k_group == 64 and WEIGHTED["kvw6"].k_group == 0


@pytest.mark.parametrize("name", sorted(PLAIN))
@pytest.mark.parametrize("part", [0, 1])
def test_without_weights_a_weighted_codec_decodes_to_its_plain_codecs_values(name: str, part: int) -> None:
    """An uncalibrated region ships kvw6 as kv6's steps: never worse than kv6."""
    x = kv_like((3, 200, 64), "float32", seed=8, decades=2)
    meta = TensorMeta("float32", tuple(x.shape), part)
    plain, weighted = get_codec(PLAIN[name]), get_codec(name)
    assert weighted.decode(weighted.encode(tensor_bytes(x), meta), meta) == plain.decode(
        plain.encode(tensor_bytes(x), meta), meta
    )


def weighted_round_trip(name: str, x: torch.Tensor, dtype: str, weights: object) -> tuple[torch.Tensor, bytes]:
    codec = weighted_codec(name)
    payload = codec.encode(tensor_bytes(x), TensorMeta(dtype, tuple(x.shape), 0, weights))
    decoded = codec.decode(payload, TensorMeta(dtype, tuple(x.shape), 0))  # the decoder needs no weights
    return from_bytes(decoded, TensorMeta(dtype, tuple(x.shape), 0)), payload


@pytest.mark.parametrize("name", WEIGHTED)
@settings(max_examples=30, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_weighted_keys_come_back_within_half_of_their_own_step_never_finer_than_the_range(
    name: str, dtype: str, shape: tuple[int, int, int], seed: int
) -> None:
    x = kv_like(shape, dtype, seed, decades=2)
    g = torch.Generator().manual_seed(seed + 1)
    weights = (10 ** torch.empty(shape[0], shape[2]).uniform_(-3, 3, generator=g)).numpy()
    y, payload = weighted_round_trip(name, x, dtype, weights)
    if not x.numel():
        return
    q = WEIGHTED[name]
    tokens = x.shape[1]
    size = q.k_group or max(1, tokens)
    groups = -(-tokens // size)
    steps = key_steps(payload, tuple(x.shape), groups)  # what the encoder chose
    x64, y64 = x.double(), y.double()
    centred = x64 - x64.mean(dim=1, keepdim=True)
    step = torch.cat([steps[:, i].expand(-1, min(size, tokens - i * size), -1) for i in range(groups)], dim=1)
    amax = torch.cat([centred[:, i : i + size].abs().amax(dim=1, keepdim=True).expand_as(centred[:, i : i + size])
                      for i in range(0, tokens, size)], dim=1)  # fmt: skip
    # codes never clip: no step below the group's range / qmax (but bf16's rounding of it)
    assert bool((step.double() >= amax / q.k_qmax * (1 - 2.0**-8) - 1e-30).all())
    bound = step.double() * 0.5 + amax * 2.0**-8 + ROUNDING[dtype] * y64.abs() + 1e-6 * (x64.abs() + amax) + 2e-24
    assert bool(((y64 - x64).abs() <= bound * 1.01).all())


def test_weights_move_the_keys_error_to_the_channels_the_queries_do_not_read() -> None:
    """A level below the code range leaves weighted channels room for finer steps: at about the same
    bytes, the error that queries see (sum of w * err^2) falls several-fold."""
    shape = (2, 512, 64)
    x = kv_like(shape, "float32", seed=11, decades=1)
    weights = torch.ones(2, 64)
    weights[:, ::8] = 1000.0  # queries read one channel in eight
    codec = KVQuantizedCodec(CodecId.KV8, "kvqw-test", KVQuantizer("kvqw-test", 127, 63, 0, 31))
    plain = codec.encode(tensor_bytes(x), TensorMeta("float32", shape, 0))
    weighted = codec.encode(tensor_bytes(x), TensorMeta("float32", shape, 0, weights.numpy()))
    meta = TensorMeta("float32", shape, 0)

    def seen_error(payload: bytes) -> float:
        y = from_bytes(codec.decode(payload, meta), meta)
        return float(((y - x).pow(2) * weights.view(2, 1, 64)).sum())

    assert seen_error(weighted) < seen_error(plain) / 4
    assert len(weighted) < len(plain) * 1.15


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        (torch.ones(3, 8), "shape"),
        (torch.full((2, 8), float("nan")), "finite"),
        (-torch.ones(2, 8), "non-negative"),
        (torch.zeros(2, 8), "not all zero"),
    ],
)
def test_bad_key_weights_are_refused(weights: torch.Tensor, match: str) -> None:
    x = kv_like((2, 16, 8), "float32", seed=3)
    with pytest.raises(CodecError, match=match):
        weighted_codec("kvw6").encode(tensor_bytes(x), TensorMeta("float32", (2, 16, 8), 0, weights.numpy()))


@pytest.mark.parametrize(("name", "part"), [("kv8", 0), ("kv6", 0), ("kv4", 0), ("kvw6", 1), ("kvw4", 1)])
def test_unweighted_codecs_and_values_ignore_key_weights(name: str, part: int) -> None:
    """A calibrated prefill region ships kv8, kv6 and kv4 payloads, and any codec's values, byte for byte."""
    x = kv_like((2, 16, 8), "float32", seed=4)
    codec = get_codec(name)
    plain = codec.encode(tensor_bytes(x), TensorMeta("float32", (2, 16, 8), part))
    skewed = np.array([[1000.0] * 2 + [1.0] * 6] * 2, dtype=np.float32)
    assert codec.encode(tensor_bytes(x), TensorMeta("float32", (2, 16, 8), part, skewed)) == plain


def test_a_shipment_checks_its_key_weights_against_its_layers() -> None:
    from prfaas.transport.api import ShipmentSpec

    shapes = ((2, 10, 8), (2, 10, 8))
    ShipmentSpec("j", 1, "t", "float32", shapes, codec="kv8", key_weights=torch.ones(2, 2, 8).numpy())
    with pytest.raises(ValueError, match="layers"):
        ShipmentSpec("j", 1, "t", "float32", shapes, codec="kv8", key_weights=torch.ones(1, 2, 8).numpy())
    with pytest.raises(ValueError, match=r"key_weights\[0\]"):
        ShipmentSpec("j", 1, "t", "float32", shapes, codec="kv8", key_weights=torch.ones(2, 3, 8).numpy())


def test_a_shipment_in_kvw6_carries_the_steps_its_key_weights_set(kit: Kit) -> None:
    """End to end through the sender and a receiver: each layer's keys arrive as the weighted encoder
    made them (not as an unweighted kvw6 would), values as any kvw6 would, and no weights travel."""
    from transport_kit import fill

    from prfaas.transport.api import Shipment, TransferStatus
    from prfaas.transport.inproc import InProcessChannel, InProcessReceiver

    shape = (3, 128, 64)
    base = kit.spec(codec="kvw6", num_layers=2, shape=shape)
    g = torch.Generator().manual_seed(2)
    weights = (10 ** torch.empty(2, 3, 64).uniform_(-2, 2, generator=g)).numpy()
    spec = dataclasses.replace(base, key_weights=weights)

    def part(seed: int) -> bytes:
        return tensor_bytes(kv_like(shape, "bfloat16", seed=seed))

    layers = [(part(20 + i), part(30 + i)) for i in range(2)]
    receiver = InProcessReceiver(kit.verifier)
    inbound = receiver.expect(spec.job_id, spec.attempt, timeout_s=10)
    shipment = Shipment(spec)
    transfer = InProcessChannel(receiver).submit(shipment)
    fill(shipment, layers)
    assert transfer.wait(10) is TransferStatus.COMPLETED and inbound.wait(10) is TransferStatus.COMPLETED
    codec = get_codec("kvw6")
    for index, (k, v) in enumerate(layers):
        k_meta, v_meta = TensorMeta("bfloat16", shape, 0, weights[index]), TensorMeta("bfloat16", shape, 1)
        got_k, got_v = inbound.layer(index, timeout_s=1)
        assert bytes(got_k) == codec.decode(codec.encode(k, k_meta), k_meta)
        unweighted = TensorMeta("bfloat16", shape, 0)
        assert bytes(got_k) != codec.decode(codec.encode(k, unweighted), unweighted)
        assert bytes(got_v) == codec.decode(codec.encode(v, v_meta), v_meta)


@pytest.mark.parametrize("name", KV_CODECS)
@pytest.mark.parametrize(("dtype", "value"), [("bfloat16", 2.5e38), ("float32", 3.3e38)])
def test_values_whose_step_is_past_bfloat16_are_refused_at_encode_not_at_decode(
    name: str, dtype: str, value: float
) -> None:
    """Rotated values near float32's largest have a 4-bit step past bfloat16's range: the sender refuses them
    (use a lossless codec) rather than ship a payload the receiver refuses after every byte crossed."""
    codec = get_codec(name)
    meta = TensorMeta(dtype, (1, 4, 128), 1)
    try:
        payload = codec.encode(tensor_bytes(torch.full((1, 4, 128), value, dtype=TORCH[dtype])), meta)
    except CodecError:
        return
    assert bool(torch.isfinite(from_bytes(codec.decode(payload, meta), meta)).all())
