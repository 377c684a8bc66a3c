"""A minimal, self-checking byte form of a `KVCache` (one blob, one request).

This is the engine's hand-off format between processes; the chunked, streamed wire format
with codecs and acknowledgements is the transport's (docs/wire-format.md).

Layout (all integers little-endian):

    offset  size  field
    0       4     magic  b"PFKV"
    4       2     version (1)
    6       2     flags (0; a reader refuses unknown flags)
    8       4     header_len: bytes of the JSON header that follows (<= 1 MiB)
    12      8     checksum: xxh3-64 of header + payload
    20      n     header: UTF-8 JSON object (see `_header`)
    20+n    m     payload: for each layer, K then V, each [num_kv_heads, num_tokens, head_dim]
                  in C order, in the header's dtype

Any altered byte after the prefix fails the checksum. A reader that sees another version
raises `KVFormatError` naming both versions rather than guess.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
import xxhash

from prfaas.engine.errors import KVChecksumMismatch, KVFormatError, KVTruncated
from prfaas.engine.kv import DTYPES, KVCache, LayerKV

MAGIC = b"PFKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")
_MAX_HEADER_BYTES = 1 << 20


def _header(kv: KVCache, payload_len: int) -> dict[str, Any]:
    return {
        "model_fingerprint": kv.model_fingerprint,
        "dtype": kv.dtype,
        "num_tokens": kv.num_tokens,
        "token_ids_hash": kv.token_ids_hash,
        "layer_shapes": [list(layer.k.shape) for layer in kv.layers],
        "payload_bytes": payload_len,
    }


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().data.cast("B")


def kv_to_bytes(kv: KVCache) -> bytes:
    """Serialize `kv` into one self-describing, checksummed blob."""
    parts = [_tensor_bytes(t) for layer in kv.layers for t in (layer.k, layer.v)]
    header = json.dumps(_header(kv, sum(len(p) for p in parts)), sort_keys=True).encode()
    hasher = xxhash.xxh3_64(header)
    for part in parts:
        hasher.update(part)
    out = bytearray(_PREFIX.pack(MAGIC, VERSION, 0, len(header), hasher.intdigest()))
    out += header
    for part in parts:
        out += part
    return bytes(out)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, or nested past the parser's depth
        raise KVFormatError(f"KV header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise KVFormatError("KV header is not a JSON object")
    fields = {
        "model_fingerprint": str,
        "dtype": str,
        "num_tokens": int,
        "token_ids_hash": str,
        "layer_shapes": list,
        "payload_bytes": int,
    }
    for name, kind in fields.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool):
            raise KVFormatError(f"KV header field {name!r} is missing or not a {kind.__name__}")
    if header["dtype"] not in DTYPES:
        raise KVFormatError(f"KV header dtype {header['dtype']!r} is not one of {sorted(DTYPES)}")
    if header["num_tokens"] < 0 or header["payload_bytes"] < 0:
        raise KVFormatError("KV header has a negative count")
    for shape in header["layer_shapes"]:
        valid = isinstance(shape, list) and len(shape) == 3
        if not valid or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise KVFormatError(f"KV header layer shape {shape!r} is not [heads, tokens, head_dim]")
        if shape[1] != header["num_tokens"]:
            raise KVFormatError(f"KV header layer shape {shape} disagrees with num_tokens {header['num_tokens']}")
    return header


def kv_from_bytes(data: bytes | bytearray | memoryview) -> KVCache:
    """Parse bytes from `kv_to_bytes`.

    Raises `KVTruncated` if the data ends early, `KVChecksumMismatch` if any byte after the
    prefix was altered, and `KVFormatError` for anything else that is not this format.
    """
    buf = memoryview(data).cast("B")
    if len(buf) < _PREFIX.size:
        raise KVTruncated(f"KV data truncated: {len(buf)} bytes, the fixed prefix alone is {_PREFIX.size}")
    magic, version, flags, header_len, checksum = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise KVFormatError(f"not prfaas KV data: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise KVFormatError(f"unsupported KV format version {version}; this build reads version {VERSION}")
    if flags != 0:
        raise KVFormatError(f"unsupported KV format flags {flags:#06x}")
    if header_len > _MAX_HEADER_BYTES:
        raise KVFormatError(f"KV header of {header_len} bytes exceeds the {_MAX_HEADER_BYTES}-byte limit")
    start = _PREFIX.size + header_len
    if len(buf) < start:
        raise KVTruncated(f"KV data truncated inside the header: {len(buf)} of at least {start} bytes")
    # Lengths come from the header, so check it before trusting any of them; the payload
    # is covered by the same checksum once its length is known.
    header = _parse_header(bytes(buf[_PREFIX.size : start]))
    dtype = DTYPES[header["dtype"]]
    itemsize = torch.empty((), dtype=dtype).element_size()
    shapes = [tuple(s) for s in header["layer_shapes"]]
    expected = sum(2 * itemsize * s[0] * s[1] * s[2] for s in shapes)
    if header["payload_bytes"] != expected:
        raise KVFormatError(f"KV header payload_bytes {header['payload_bytes']} != {expected} implied by its shapes")
    if len(buf) < start + expected:
        raise KVTruncated(f"KV data truncated: {len(buf)} bytes, header announces {start + expected}")
    if len(buf) > start + expected:
        raise KVFormatError(f"KV data has {len(buf) - start - expected} trailing bytes after the payload")
    if xxhash.xxh3_64_intdigest(buf[_PREFIX.size :]) != checksum:
        raise KVChecksumMismatch("KV data checksum mismatch: the data was altered in transit or storage")
    payload = buf[start:]
    # One copy out of the caller's buffer; tensors then own their memory.
    owned = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8)
    layers, offset = [], 0
    for shape in shapes:
        size = itemsize * shape[0] * shape[1] * shape[2]
        k = owned[offset : offset + size].view(dtype).reshape(shape)
        v = owned[offset + size : offset + 2 * size].view(dtype).reshape(shape)
        layers.append(LayerKV(k=k, v=v))
        offset += 2 * size
    return KVCache(
        model_fingerprint=header["model_fingerprint"],
        dtype=header["dtype"],
        layers=tuple(layers),
        num_tokens=header["num_tokens"],
        token_ids_hash=header["token_ids_hash"],
    )
