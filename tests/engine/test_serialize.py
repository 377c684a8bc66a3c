import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.engine.errors import InvalidPrompt, KVChecksumMismatch, KVFormatError, KVTruncated
from prfaas.engine.kv import DTYPES, KVCache, LayerKV, hash_token_ids
from prfaas.engine.serialize import kv_from_bytes, kv_to_bytes


def make_kv(num_layers: int = 3, heads: int = 2, tokens: int = 5, head_dim: int = 4, dtype: str = "float32") -> KVCache:
    g = torch.Generator().manual_seed(num_layers * 1000 + tokens)
    layers = tuple(
        LayerKV(
            k=torch.randn(heads, tokens, head_dim, generator=g).to(DTYPES[dtype]),
            v=torch.randn(heads, tokens, head_dim, generator=g).to(DTYPES[dtype]),
        )
        for _ in range(num_layers)
    )
    return KVCache("fp-test", dtype, layers, tokens, hash_token_ids(list(range(tokens))))


def assert_same(a: KVCache, b: KVCache) -> None:
    assert (a.model_fingerprint, a.dtype, a.num_tokens, a.token_ids_hash) == (
        b.model_fingerprint,
        b.dtype,
        b.num_tokens,
        b.token_ids_hash,
    )
    assert a.num_layers == b.num_layers
    for x, y in zip(a.layers, b.layers, strict=True):
        # Bit-exact: compare raw bytes, so NaN payloads and -0.0 count too.
        assert torch.equal(x.k.view(torch.uint8), y.k.view(torch.uint8))
        assert torch.equal(x.v.view(torch.uint8), y.v.view(torch.uint8))


@settings(max_examples=40, deadline=None)
@given(
    num_layers=st.integers(0, 4),
    heads=st.integers(1, 3),
    tokens=st.integers(0, 9),
    head_dim=st.integers(1, 8),
    dtype=st.sampled_from(sorted(DTYPES)),
)
def test_roundtrip_is_bit_exact(num_layers: int, heads: int, tokens: int, head_dim: int, dtype: str) -> None:
    kv = make_kv(num_layers, heads, tokens, head_dim, dtype)
    data = kv_to_bytes(kv)
    assert_same(kv_from_bytes(data), kv)
    assert len(data) > kv.nbytes  # header on top of the raw payload


def test_every_truncation_is_reported_as_truncated() -> None:
    data = kv_to_bytes(make_kv())
    for cut in [0, 3, 11, 12, 40, len(data) // 2, len(data) - 1]:
        with pytest.raises(KVTruncated, match="truncated"):
            kv_from_bytes(data[:cut])


def test_flipped_payload_byte_fails_the_checksum() -> None:
    data = bytearray(kv_to_bytes(make_kv()))
    data[-7] ^= 0x01
    with pytest.raises(KVChecksumMismatch, match="checksum mismatch"):
        kv_from_bytes(bytes(data))
    header_byte = bytearray(kv_to_bytes(make_kv()))
    header_byte[header_byte.index(b"fp-test")] = ord("g")  # still valid JSON, other model
    with pytest.raises(KVChecksumMismatch):
        kv_from_bytes(bytes(header_byte))


def test_bad_magic_and_unknown_version_are_refused() -> None:
    data = kv_to_bytes(make_kv())
    with pytest.raises(KVFormatError, match="not prfaas KV data"):
        kv_from_bytes(b"XXXX" + data[4:])
    newer = data[:4] + struct.pack("<H", 2) + data[6:]
    with pytest.raises(KVFormatError, match="unsupported KV format version 2; this build reads version 1"):
        kv_from_bytes(newer)


def test_trailing_garbage_is_refused() -> None:
    with pytest.raises(KVFormatError, match="trailing bytes"):
        kv_from_bytes(kv_to_bytes(make_kv()) + b"\0")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_a_format_error_never_a_crash(data: bytes) -> None:
    with pytest.raises(KVFormatError):
        kv_from_bytes(b"PFKV" + data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_altered_byte_is_refused(data: st.DataObject) -> None:
    blob = bytearray(kv_to_bytes(make_kv(num_layers=1, tokens=2)))
    index = data.draw(st.integers(0, len(blob) - 1))
    blob[index] ^= data.draw(st.integers(1, 255))
    with pytest.raises(KVFormatError):
        kv_from_bytes(bytes(blob))


def test_a_header_nested_past_the_parsers_depth_is_a_format_error() -> None:
    header = b"[" * 5000  # within the header limit; json.loads raises RecursionError on it
    blob = struct.pack("<4sHHIQ", b"PFKV", 1, 0, len(header), 0) + header
    with pytest.raises(KVFormatError, match="not valid JSON"):
        kv_from_bytes(blob)


def test_a_token_id_past_int32_is_an_invalid_prompt_and_valid_ids_keep_their_hash() -> None:
    # decode.proto carries token ids as uint32: 2^31 .. 2^32 - 1 reach the hash, which reads int32
    for bad in (1 << 31, (1 << 32) - 1):
        with pytest.raises(InvalidPrompt, match=str(bad)):
            hash_token_ids([1, bad])
    # pinned: a decode region checks a prefill region's hash (another process, maybe another release)
    assert hash_token_ids([0, 1, 49151, (1 << 31) - 1]) == "80c9a2e5f4b238ac"
