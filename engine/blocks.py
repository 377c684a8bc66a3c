"""Prompt blocks and their chained hashes: the one scheme the API (which places a request by
the prefixes regions hold) and the regions (which keep those prefixes) both use.

A prompt is cut into blocks of `block_tokens` tokens; only full blocks are hashed. Block i's
digest is BLAKE2b-128 over (block i-1's digest, or the salt's digest for block 0) and block
i's token ids as little-endian int32, so each digest names its whole prefix: two prompts
share block i's digest only if they share every token up to the end of block i.

- A cryptographic hash, as vLLM's default since its prefix-cache CVE: with a fast
  non-cryptographic one, a tenant could craft a prompt whose blocks collide with another
  tenant's and be served KV computed from that tenant's prompt.
- The salt scopes a cache: regions reuse a block only for requests with the same salt (the
  control plane salts with the tenant's id by default, `prefix_cache_scope`), so a tenant
  cannot learn from its latency which prompts other tenants sent.
- What regions publish and the scheduler compares is `short`: the digest's first 8 bytes
  in hex. It is a hint (a collision misleads a placement, never an output); a region looks
  blocks up by the full digest.

hashlib and numpy, no torch: the API process imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from prfaas.engine.errors import InvalidPrompt

DEFAULT_BLOCK_TOKENS = 64
DIGEST_BYTES = 16
INT32_RANGE = range(-(1 << 31), 1 << 31)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """`token_ids` as little-endian int32, what every hash of a prompt reads. InvalidPrompt names an id
    outside int32 (the wire's uint32 reaches 2^32 - 1; no vocabulary does): rather than widen the ids,
    which would change every hash regions and the API already share."""
    try:
        return np.asarray(token_ids, dtype="<i4").tobytes()
    except OverflowError:
        bad = next((t for t in token_ids if t not in INT32_RANGE), None)
        raise InvalidPrompt(f"token id {bad} is outside every vocabulary (int32)") from None


def salt_digest(salt: str) -> bytes:
    """Block 0's parent: the digest of the salt ("" for an unsalted, shared cache)."""
    return hashlib.blake2b(salt.encode(), digest_size=DIGEST_BYTES, person=b"prfaas-prefix").digest()


def block_hashes(token_ids: Sequence[int], block_tokens: int, salt: str = "", limit: int | None = None) -> list[bytes]:
    """The chained digest of each full block of `token_ids`, first block first (at most `limit`)."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be at least 1")
    count = len(token_ids) // block_tokens if limit is None else min(limit, len(token_ids) // block_tokens)
    if count <= 0:
        return []
    data = token_bytes(token_ids[: count * block_tokens])
    step = 4 * block_tokens
    parent = salt_digest(salt)
    out = []
    for i in range(count):
        parent = hashlib.blake2b(parent + data[i * step : (i + 1) * step], digest_size=DIGEST_BYTES).digest()
        out.append(parent)
    return out


def short(digest: bytes) -> str:
    """What regions publish and the scheduler matches: the first 8 bytes, 16 hex digits."""
    return digest[:8].hex()
