"""Each layer's KV-cache spec against numbers worked out by hand, and the groups made from the specs."""

from __future__ import annotations

import pytest

from app import catalog
from app.cache import spec
from app.cache.spec import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, kv_cache_groups
from app.kv_bytes import MLA

GEMMA = catalog.get("gemma-3-270m")


def test_full_attention_page_and_holdings_by_hand():
    # SmolLM2-135M, one layer, bf16: K and V · 3 heads · 64 · 2 B = 768 B a token; 30 layers = 23 040 B (vLLM's figure).
    layer = FullAttentionSpec(n_kv_head=3, head_dim=64)
    assert layer.bytes_per_token("bf16") == 2 * 3 * 64 * 2 == 768
    assert sum(s.bytes_per_token("bf16") for s in spec.from_config(catalog.get("smollm2-135m"))) == 23_040
    assert layer.page_size_bytes(16, "bf16") == 16 * 768 == 12_288
    assert layer.page_size_bytes(32, "fp32") == 32 * 2 * 3 * 64 * 4
    assert [layer.tokens_held(n) for n in (0, 1, 100, 5000)] == [0, 1, 100, 5000]
    assert [layer.blocks_held(n, 16) for n in (0, 1, 16, 17, 4096)] == [0, 1, 1, 2, 256]
    assert layer.max_memory_usage_bytes(max_model_len=2048, block_size=16) == 128 * 12_288
    assert layer.kind == "full_attention" and layer.sliding_window is None


def test_sliding_window_holds_its_window_in_at_most_ceil_w_over_b_plus_one_blocks():
    w = SlidingWindowSpec(n_kv_head=1, head_dim=256, sliding_window=512)  # a gemma-3-270m local layer
    assert w.page_size_bytes(16, "bf16") == 16 * 2 * 256 * 2 == 16_384
    assert w.tokens_held(256) == 256 and w.tokens_held(512) == 512 and w.tokens_held(4096) == 512
    # 4096 tokens: positions 3584..4095, blocks 224..255 (the window starts on a block boundary): 32 blocks.
    assert w.blocks_held(4096, 16) == 32
    # 1000 tokens: positions 488..999, block 30 (488 // 16) to block 62 (999 // 16): 33 blocks.
    assert w.blocks_held(1000, 16) == 62 - 30 + 1 == 33
    # W = 5, blocks of 4, 11 tokens: token 10 reads 6..10, blocks 1 and 2; 6 tokens skipped = 1 whole block.
    small = SlidingWindowSpec(1, 2, 5)
    assert small.num_skipped_tokens(10) == 6 and small.blocks_held(11, 4) == 2 and small.tokens_held(11) == 5
    for window in (1, 5, 8, 16, 17, 512):
        s = SlidingWindowSpec(1, 2, window)
        for bs in (1, 4, 16):
            held = [s.blocks_held(n, bs) for n in range(1, 3 * window + 40)]
            assert max(held) <= -(-window // bs) + 1
            # blocks held = blocks covering the last min(n, W) positions, counted position by position
            for n, h in enumerate(held, start=1):
                assert h == len({p // bs for p in range(max(0, n - window), n)})
    # vLLM's max memory: W - 1 computed tokens plus a step's batch, in blocks, plus one for the unaligned start.
    assert w.max_memory_usage_bytes(max_model_len=32768, block_size=16, max_num_batched_tokens=2048) == \
        (-(-(511 + 2048) // 16) + 1) * 16_384
    assert w.kind == "sliding_window" and w.sliding_window == 512
    with pytest.raises(ValueError):
        SlidingWindowSpec(1, 2, 0)


def test_mla_caches_one_latent_vector_per_token():
    m = MLAAttentionSpec.of(MLA(kv_lora_rank=512, qk_rope_head_dim=64))  # DeepSeek-V2-Lite
    assert m.bytes_per_token("bf16") == (512 + 64) * 2 == 1152  # no ×2: no separate K and V
    assert m.bytes_per_token("bf16", tp=4) == 1152  # the latent vector is not split across GPUs
    assert m.page_size_bytes(16, "bf16") == 16 * 1152
    assert m.tokens_held(9000) == 9000 and m.kind == "mla_attention"
    assert spec.from_config(catalog.get("deepseek-v2-lite"))[0] == m


def test_gemma3_270m_request_bytes_by_hand():
    """bf16, blocks of 16: a layer's token is 1024 B. 4096 tokens: 3 full layers · 256 blocks + 15 local layers · 32
    blocks; 256 tokens: every layer 16 blocks."""
    specs = spec.from_config(GEMMA)
    assert spec.request_bytes(specs, 4096, block_size=16) == (3 * 256 + 15 * 32) * 16 * 1024 == 20_447_232
    assert spec.request_bytes(specs, 256, block_size=16) == 18 * 16 * 16 * 1024 == 4_718_592
    kinds = spec.kind_rows(specs, 4096, block_size=16)
    assert [(k["kind"], k["window"], k["n_layers"], k["blocks"]) for k in kinds] == [("full", None, 3, 256),
                                                                                     ("sliding", 512, 15, 32)]


def test_groups_are_made_once_from_the_specs():
    groups = kv_cache_groups(spec.from_config(GEMMA))
    assert [g.layers for g in groups] == [(5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert [g.window for g in groups] == [None] + [512] * 5 and spec.group_size(groups) == 3
    # A pool of these groups: a block holds 3 layers' pages (not 18): 3 · 16 · 1024 B.
    assert spec.block_bytes(groups, 16, "bf16") == 49_152
    assert spec.pool_bytes(spec.from_config(GEMMA), num_blocks=10, block_size=16, dtype="bf16") == 491_520
    plain = spec.from_config(catalog.get("smollm2-135m"))
    (one,) = kv_cache_groups(plain)
    assert one.layers == tuple(range(30)) and spec.block_bytes([one], 16, "bf16") == 16 * 23_040
    # The largest kind under 1.5x the smallest: groups as large as the largest kind (vLLM pads the smaller one).
    mixed = [SlidingWindowSpec(1, 2, 8)] * 7 + [FullAttentionSpec(1, 2)] * 5
    assert [len(g.layers) for g in kv_cache_groups(mixed)] == [5, 7]
    # Otherwise as large as the smallest kind: 6 local layers and 4 full ones are cut into groups of 4.
    apart = [SlidingWindowSpec(1, 2, 8)] * 6 + [FullAttentionSpec(1, 2)] * 4
    assert [len(g.layers) for g in kv_cache_groups(apart)] == [4, 4, 2]


def test_the_calculator_and_the_model_sizes_read_the_specs():
    from app.capacity.calculator import CalcInput, calculate

    r = calculate(GEMMA, CalcInput(context=4096, block_size=16, dtype="bf16"))
    assert r["request_bytes"] == spec.request_bytes(spec.from_config(GEMMA), 4096, block_size=16)
    assert r["block_bytes"] == 49_152 and r["num_blocks"] == int(r["kv_memory"] // 49_152)
    assert len(r["kv_cache_groups"]) == 6
    sizes = spec.sizes(GEMMA)
    assert sizes["bytes_per_token"] == 18 * 1024 and sizes["layer_bytes"] == 1024
    assert [(k["kind"], k["n_layers"], k["bytes_per_token"]) for k in sizes["kinds"]] == [("full", 3, 3 * 1024),
                                                                                          ("sliding", 15, 15 * 1024)]
