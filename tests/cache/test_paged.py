"""The block manager, narrated step by step, and decoding through it equal to the contiguous cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from app.cache.paged import PagedKVCache, PoolExhausted, blocks_needed
from app.cache.paged_decode import FloatKVStore, PagedSeqStore, forward_through
from app.cache.spec import from_adapter


def small_pool(num_blocks: int = 6, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(num_blocks=num_blocks, block_size=block_size, n_layer=2, n_kv_head=2, head_dim=3)


def append_slot(pool: PagedKVCache, seq_id: int) -> tuple[int, int]:
    """Reserve the slot of the sequence's next token: (physical block id, offset in block)."""
    pool.append_slots(seq_id, 1)
    return pool.slot(seq_id, pool.num_tokens[seq_id] - 1)


def kv(value: float, t: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((2, t, 3), value)  # (H, T, Dh)
    return k, -k


def test_blocks_needed_is_a_ceiling():
    assert [blocks_needed(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_a_sequence_lives_and_dies_in_the_pool():
    pool = small_pool()

    # 1. Allocate: a 6-token prompt takes ceil(6/4) = 2 blocks from the front of the free queue.
    assert pool.allocate(0, 6) == [0, 1]
    assert pool.num_free_blocks == 4 and pool.tail_waste(0) == 2
    pool.write_kv(0, 0, 0, *kv(1.0, 6))

    # 2. Append: tokens 6 and 7 fill block 1; token 8 crosses the boundary and gets block 2.
    assert append_slot(pool, 0) == (1, 2)
    assert append_slot(pool, 0) == (1, 3)
    assert pool.blocks_to_append(0) == 1
    assert append_slot(pool, 0) == (2, 0)
    assert pool.block_tables[0] == [0, 1, 2] and pool.tail_waste(0) == 3
    pool.write_kv(0, 0, 6, *kv(2.0, 3))
    keys, values = pool.gather_kv(0, 0)
    assert keys.shape == (2, 9, 3)
    assert keys[0, :, 0].tolist() == [1.0] * 6 + [2.0] * 3 and torch.equal(values, -keys)

    # 3. Finish: blocks go back to the free queue tail first, so block 2 (the tail) is freed first.
    assert pool.free(0) == [2, 1, 0]
    assert pool.num_free_blocks == 6 and all(b.ref_cnt == 0 for b in pool.blocks)

    # 4. Reuse after free: the queue is FIFO, so the never-used blocks 3, 4 come before the freed ones.
    assert pool.allocate(1, 8) == [3, 4]
    assert pool.allocate(2, 12) == [5, 2, 1]


def test_fork_then_write_copies_only_the_tail_block():
    pool = small_pool()
    pool.allocate(0, 6)  # blocks [0, 1]: block 0 full, block 1 holds 2 tokens
    pool.write_kv(0, 0, 0, *kv(1.0, 6))

    # Fork: the child shares both blocks; nothing is copied, ref counts go to 2.
    assert pool.fork(0, 1) == [0, 1]
    assert [pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert pool.num_free_blocks == 4

    # Writing into the shared tail directly is refused: no corruption of the other sequence.
    pool.num_tokens[1] += 1
    with pytest.raises(RuntimeError, match="shared"):
        pool.write_kv(1, 0, 6, *kv(9.0))
    pool.num_tokens[1] -= 1

    # The child's next slot: its tail is shared, so block 1 is copied into a fresh block (copy-on-write).
    assert pool.blocks_to_append(1) == 1
    block, offset = append_slot(pool, 1)
    assert (block, offset) == (2, 2)
    assert pool.block_tables[1] == [0, 2] and pool.block_tables[0] == [0, 1]
    assert [pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    assert pool.cow_copies == 1
    pool.write_kv(1, 0, 6, *kv(9.0))

    # The copy carried the two written slots; the parent's history is untouched.
    child_k, _ = pool.gather_kv(1, 0)
    parent_k, _ = pool.gather_kv(0, 0)
    assert child_k[0, :, 0].tolist() == [1.0] * 6 + [9.0]
    assert parent_k[0, :, 0].tolist() == [1.0] * 6

    # The parent now owns its tail alone: it writes in place, no second copy.
    assert pool.blocks_to_append(0) == 0
    assert append_slot(pool, 0) == (1, 2)
    assert pool.cow_copies == 1

    # Cancel the child: only its private block is freed; the shared block 0 stays for the parent.
    assert pool.free(1) == [2]
    assert pool.blocks[0].ref_cnt == 1


def test_pool_exhausted_changes_nothing():
    pool = small_pool(num_blocks=3)
    pool.allocate(0, 8)  # blocks 0, 1 full
    with pytest.raises(PoolExhausted) as exc:
        pool.allocate(1, 5)  # needs 2, 1 free
    assert (exc.value.needed, exc.value.free) == (2, 1)
    assert pool.block_tables.get(1) is None and pool.num_free_blocks == 1

    append_slot(pool, 0)  # token 8 takes the last block
    for _ in range(3):
        append_slot(pool, 0)  # fills it
    before = (list(pool.block_tables[0]), pool.num_tokens[0], [b.ref_cnt for b in pool.blocks])
    with pytest.raises(PoolExhausted):
        append_slot(pool, 0)
    assert (pool.block_tables[0], pool.num_tokens[0], [b.ref_cnt for b in pool.blocks]) == before


def test_bytes_per_block_is_the_formula(distil):
    a = distil.adapter
    pool = PagedKVCache(num_blocks=2, block_size=16, n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim)
    assert pool.bytes_per_block == 2 * 6 * 12 * 16 * 64 * 4  # K and V, layers, heads, slots, head_dim, fp32


# --- decoding through the block table ---------------------------------------------------------------

def test_paged_decode_equals_the_contiguous_cache_for_30_steps(distil):
    """Greedy, 30 steps, block size 4 so the sequence crosses many block boundaries."""
    ids = distil.encode("The cat sat on")
    pool = PagedKVCache(num_blocks=12, block_size=4, n_layer=6, n_kv_head=12, head_dim=64)
    store = PagedSeqStore(pool, 0)
    cache = DynamicCache(config=distil.model.config)
    feed = ids
    with torch.no_grad():
        for step in range(31):
            ours = forward_through(distil, store, feed)[-1]
            out = distil.model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True)
            cache = out.cache
            theirs = out.logits[0, -1]
            assert (ours - theirs).abs().max() <= 1e-4, step
            assert int(ours.argmax()) == int(theirs.argmax()), step
            feed = [int(theirs.argmax())]
    assert pool.num_tokens[0] == len(ids) + 30
    assert len(pool.block_tables[0]) == blocks_needed(len(ids) + 30, 4)
    # The K/V read back through the block table are the DynamicCache's, token for token.
    for layer in range(6):
        k, v = pool.gather_kv(0, layer)
        assert torch.allclose(k, cache.layers[layer].keys[0], atol=1e-5)
        assert torch.allclose(v, cache.layers[layer].values[0], atol=1e-5)


def test_a_forked_branch_decodes_as_if_it_were_alone(tiny):
    """Parent and child share blocks; after copy-on-write each one's logits equal a private cache's."""
    ids = tiny.encode("the cat sat")
    a = tiny.adapter
    pool = PagedKVCache(num_blocks=8, block_size=4, n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim)
    parent = PagedSeqStore(pool, 0)
    logits = forward_through(tiny, parent, ids)[-1]
    top2 = torch.topk(logits, 2).indices.tolist()
    pool.fork(0, 1)
    child = PagedSeqStore(pool, 1)
    branches = {0: (parent, [top2[0]]), 1: (child, [top2[1]])}
    private = {b: FloatKVStore(a.n_layer) for b in branches}
    for b in branches:
        forward_through(tiny, private[b], ids)
    for _step in range(6):
        for b, (store, toks) in branches.items():
            paged = forward_through(tiny, store, [toks[-1]])[-1]
            alone = forward_through(tiny, private[b], [toks[-1]])[-1]
            assert (paged - alone).abs().max() <= 1e-5
            toks.append(int(paged.argmax()))
    assert pool.cow_copies == 1  # only the shared tail was copied, once
    shared = set(pool.block_tables[0]) & set(pool.block_tables[1])
    assert all(pool.blocks[i].ref_cnt == 2 for i in shared)
    assert len(shared) == len(ids) // 4  # the full prompt blocks stay shared


# --- sliding-window layers: block tables of their own that give blocks back ---------------------------------

def _specs(windows):
    from app.cache.spec import layer_spec

    return [layer_spec(n_kv_head=1, head_dim=2, window=w) for w in windows]


def test_layers_are_grouped_by_kind_as_vllm_groups_them():
    from app.cache.paged import kv_cache_groups

    # gemma-3-270m: 15 local layers and 3 full ones -> groups of 3: one full group, five sliding ones.
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = kv_cache_groups(_specs(windows))
    assert [g.kind for g in groups] == ["full"] + ["sliding"] * 5
    assert groups[0].layers == (5, 11, 17) and groups[1].layers == (0, 1, 2) and groups[5].layers == (14, 15, 16)
    assert kv_cache_groups(_specs([None] * 4))[0].layers == (0, 1, 2, 3)  # one kind: one group of every layer
    assert [g.layers for g in kv_cache_groups(_specs([8, 8, None]))] == [(2,), (0,), (1,)]  # the tiny Gemma 3


def test_a_window_group_frees_blocks_that_fall_outside_it():
    """Layers 0, 1 local (window 5), layer 2 full; blocks of 4 slots. Group size 1: three groups, three tables."""
    pool = PagedKVCache(num_blocks=12, block_size=4, n_layer=3, n_kv_head=1, head_dim=2,
                        specs=_specs([5, 5, None]))
    assert [g.layers for g in pool.groups] == [(2,), (0,), (1,)]
    assert pool.bytes_per_block == 2 * 1 * 1 * 4 * 2 * 4  # one layer per page: K and V, 1 head, 4 slots, Dh 2, fp32
    assert pool.key_cache[0] is pool.key_cache[1] is pool.key_cache[2]  # one tensor, shared by the groups

    # Prefill 6 tokens: every group takes ceil(6/4) = 2 blocks (its queries read back to position 0).
    pool.allocate(0, 6)
    assert pool.seq_tables(0) == [[0, 1], [2, 3], [4, 5]]
    # The next query sits at 6 and reads 2..6: block 0 (positions 0..3) is still read. Nothing to free.
    assert pool.remove_skipped_blocks(0) == []
    # Tokens 6, 7 fill the tail; at 8 the query reads 4..8, so each local group gives its block 0 back.
    pool.append_slots(0, 2)
    assert pool.remove_skipped_blocks(0) == [2, 4]
    assert pool.seq_tables(0) == [[0, 1], [-1, 3], [-1, 5]] and pool.window_frees == 2
    assert pool.first_kept(0, 0) == 4 and pool.first_kept(0, 2) == 0
    # Token 8 needs a third block in every group: the freed ones are taken last (FIFO), new ones first.
    pool.append_slots(0, 1)
    assert pool.seq_tables(0) == [[0, 1, 6], [-1, 3, 7], [-1, 5, 8]]
    assert pool.num_used_blocks == 3 + 2 + 2
    # Finish: every group's blocks come back, none twice.
    assert sorted(pool.free(0)) == [0, 1, 3, 5, 6, 7, 8]
    assert pool.num_free_blocks == 12


def test_paged_decode_past_the_window_equals_transformers_cache_on_gemma3(family_models):
    """The tiny Gemma 3 (window 8 on layers 0 and 1) decodes 24 steps past its window through a paged pool whose
    local layers give blocks back: its logits are transformers' own (whose cache keeps the last W - 1), and each
    local layer never holds more than ceil(W / block) + 1 blocks."""
    lm = family_models["gemma3"]
    a = lm.adapter
    window = a.window(0)
    bs = 4
    ids = lm.encode("the cat sat on the mat and looked at")[:10]
    assert len(ids) > window
    pool = PagedKVCache(num_blocks=40, block_size=bs, n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim,
                        dtype=a.dtype, specs=from_adapter(a))
    local = [g for g, group in enumerate(pool.groups) if group.window is not None]
    assert local and len(pool.groups) == 3
    store = PagedSeqStore(pool, 0)
    cache = DynamicCache(config=lm.model.config)
    feed = ids
    for step in range(25):
        ours = forward_through(lm, store, feed)[-1]
        with torch.no_grad():
            out = lm.model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True)
        cache = out.cache
        theirs = out.logits[0, -1]
        assert (ours - theirs).abs().max() < 1e-4, step
        n = pool.num_tokens[0]
        for g in local:
            held = len(pool.held_blocks(0, g))
            assert held <= -(-window // bs) + 1, (step, held)
            # the next query, at n, reads n - W + 1 .. n: the blocks from (n - W + 1) // bs to the tail are kept
            assert held == (n - 1) // bs - max(0, n - window + 1) // bs + 1, (step, held)
        feed = [int(theirs.argmax())]
    assert pool.num_tokens[0] == len(ids) + 24
    assert len(pool.held_blocks(0, 0)) == blocks_needed(len(ids) + 24, bs)  # the full layer keeps everything
    # The K/V a local layer still holds are transformers' last W - 1, and then some of the same block.
    for layer in (0, 1):
        k, _ = pool.gather_kv(0, layer)
        theirs_k, _ = a.layer_cache(cache, layer)
        assert torch.allclose(k[:, -(window - 1):], theirs_k[0], atol=1e-5)
    assert pool.window_frees > 0
    assert store.nbytes == len(pool.held_blocks(0)) * pool.bytes_per_block

