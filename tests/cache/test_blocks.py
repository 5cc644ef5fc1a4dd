"""Block hashing and the block pool, scenario by scenario (no model needed)."""

from __future__ import annotations

import hashlib

import pytest

from app.cache.blocks import (
    NONE_HASH,
    BlockPool,
    NoFreeBlocks,
    block_extra_keys,
    fast_block_hash,
    hash_block_tokens,
    hash_request_tokens,
)

EXTRA = block_extra_keys("distilgpt2", None)


def test_hash_is_sha256_of_parent_tokens_and_extra_keys():
    # Derived a second way: the documented payload, hashed by hand.
    expected = hashlib.sha256(repr((NONE_HASH, (1, 2, 3, 4), EXTRA)).encode()).hexdigest()
    assert hash_block_tokens(None, [1, 2, 3, 4], EXTRA) == expected


def test_only_full_blocks_are_hashed():
    assert len(hash_request_tokens(list(range(9)), 4, EXTRA)) == 2  # 4 + 4 + a partial block of 1
    assert len(hash_request_tokens(list(range(8)), 4, EXTRA)) == 2
    assert hash_request_tokens(list(range(3)), 4, EXTRA) == []


def test_hashes_are_chained():
    hashes = hash_request_tokens([1, 2, 3, 4, 5, 6, 7, 8], 4, EXTRA)
    h0 = hash_block_tokens(None, [1, 2, 3, 4], EXTRA)
    assert hashes == [h0, hash_block_tokens(h0, [5, 6, 7, 8], None)]


def test_same_tokens_after_a_different_prefix_get_a_different_key():
    a = hash_request_tokens([1, 2, 3, 4, 5, 6, 7, 8], 4, EXTRA)
    b = hash_request_tokens([9, 9, 9, 9, 5, 6, 7, 8], 4, EXTRA)
    assert a[1] != b[1]  # block 1 holds the same tokens 5 6 7 8 in both


def test_same_prefix_gives_the_same_keys_up_to_the_first_difference():
    a = hash_request_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, EXTRA)
    b = hash_request_tokens([1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12], 4, EXTRA)
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]  # the change in block 1 propagates down the chain


def test_the_fast_block_key_is_pythons_tuple_hash_and_chains_as_sha256_does():
    # Derived a second way: the documented tuple, hashed by hand (a first block's parent is 0, no extra keys ()).
    assert fast_block_hash(None, [1, 2, 3, 4]) == hash((0, (1, 2, 3, 4), ()))
    assert fast_block_hash(7, [5, 6]) == hash((7, (5, 6), ()))
    # Over one chain, both recipes tell the same blocks apart: equal keys exactly where the sha256 keys are equal.
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 0, 8, 9], [9, 9, 9, 9, 5, 6, 7, 8, 9],
            [1, 2, 3, 4, 5, 6, 7, 8]]
    fast = [hash_request_tokens(s, 2, hash_block=fast_block_hash) for s in seqs]
    slow = [hash_request_tokens(s, 2) for s in seqs]
    for i in range(len(seqs)):
        for j in range(len(seqs)):
            for f1, f2, s1, s2 in zip(fast[i], fast[j], slow[i], slow[j], strict=False):  # the shorter's blocks
                assert (f1 == f2) == (s1 == s2)


@pytest.mark.parametrize("other", [block_extra_keys("builtin", None), block_extra_keys("distilgpt2", "alice")])
def test_another_model_or_salt_changes_every_key(other):
    tokens = list(range(12))
    a, b = hash_request_tokens(tokens, 4, EXTRA), hash_request_tokens(tokens, 4, other)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_different_salts_differ_and_equal_salts_match():
    tokens = list(range(8))
    alice = hash_request_tokens(tokens, 4, block_extra_keys("m", "alice"))
    assert alice == hash_request_tokens(tokens, 4, block_extra_keys("m", "alice"))
    assert alice != hash_request_tokens(tokens, 4, block_extra_keys("m", "bob"))
    # An empty salt is no salt.
    assert hash_request_tokens(tokens, 4, block_extra_keys("m", "")) == hash_request_tokens(
        tokens, 4, block_extra_keys("m", None))


def _allocate(pool: BlockPool, tokens: list[int], block_size: int = 4):
    """A miniature kv_cache_manager: hit what is cached, allocate the rest, register full blocks."""
    hashes = hash_request_tokens(tokens, block_size, EXTRA)
    hits = pool.find_longest_cache_hit(hashes)
    pool.touch(hits)
    new = pool.get_new_blocks(-(-len(tokens) // block_size) - len(hits))
    blocks = hits + new
    for i in range(len(hits), len(hashes)):
        pool.cache_full_block(blocks[i], hashes[i])
    return blocks, len(hits)


def test_sharing_counts_references_and_the_partial_tail_is_not_shared():
    pool = BlockPool(10)
    a, hit_a = _allocate(pool, list(range(10)))  # blocks: [0-3] [4-7] [8 9]
    b, hit_b = _allocate(pool, list(range(10)))
    assert (hit_a, hit_b) == (0, 2)
    assert [x.block_id for x in b[:2]] == [x.block_id for x in a[:2]]
    assert [x.ref_cnt for x in a] == [2, 2, 1]
    assert b[2] is not a[2]  # each request gets its own partial tail block
    assert a[2].block_hash is None and b[2].block_hash is None
    assert pool.num_used_blocks == 4


def test_released_blocks_stay_reusable_until_evicted():
    pool = BlockPool(4)
    a, _ = _allocate(pool, list(range(8)))
    pool.free_blocks(reversed(a))
    assert pool.num_used_blocks == 0 and pool.num_evictable_blocks == 2
    b, hit = _allocate(pool, list(range(8)) + [99])
    assert hit == 2 and [x.block_id for x in b[:2]] == [x.block_id for x in a]


def test_lru_eviction_order_under_a_small_capacity():
    """Capacity 4 blocks of 4 tokens. A = 8 tokens, B = 8 tokens, both finished; then C needs 2 blocks."""
    pool = BlockPool(4)
    a, _ = _allocate(pool, [1] * 8)  # blocks 0 1
    b, _ = _allocate(pool, [2] * 8)  # blocks 2 3
    pool.free_blocks(reversed(a))  # tail first: 1 then 0
    pool.free_blocks(reversed(b))  # 3 then 2
    assert [x.block_id for x in pool.eviction_order()] == [1, 0, 3, 2]
    c, hit = _allocate(pool, [3] * 8)
    assert hit == 0
    assert [x.block_id for x in c] == [1, 0]  # A was released first: least recently used, evicted first
    assert pool.num_evictions == 2
    # A's prefix is gone, B's is still found.
    assert pool.find_longest_cache_hit(hash_request_tokens([1] * 8, 4, EXTRA)) == []
    assert len(pool.find_longest_cache_hit(hash_request_tokens([2] * 8, 4, EXTRA))) == 2


def test_a_hit_refreshes_a_block_and_protects_it_from_eviction():
    pool = BlockPool(4)
    a, _ = _allocate(pool, [1] * 8)  # 0 1
    b, _ = _allocate(pool, [2] * 8)  # 2 3
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    again, hit = _allocate(pool, [1] * 8)  # A's blocks hit: they leave the free queue
    assert hit == 2 and [x.ref_cnt for x in again] == [1, 1]
    pool.free_blocks(reversed(again))  # now A is the most recently used
    assert [x.block_id for x in pool.eviction_order()] == [3, 2, 1, 0]


def test_tail_evicted_before_head():
    pool = BlockPool(3)
    a, _ = _allocate(pool, [5] * 12)  # 0 1 2
    pool.free_blocks(reversed(a))
    pool.get_new_blocks(1)  # evicts A's last block only
    hits = pool.find_longest_cache_hit(hash_request_tokens([5] * 12, 4, EXTRA))
    assert [x.block_id for x in hits] == [0, 1]


def test_allocation_fails_cleanly_when_everything_is_held():
    pool = BlockPool(2)
    _allocate(pool, [1] * 8)
    with pytest.raises(NoFreeBlocks):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.free_blocks([pool.blocks[0], pool.blocks[0], pool.blocks[0]])


def test_first_copy_of_a_hash_stays_the_cached_one():
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2, 3, 4], EXTRA)
    assert pool.cache_full_block(x, h) is True
    assert pool.cache_full_block(y, h) is False
    assert pool.get_cached_block(h) is x and y.block_hash is None


def test_reset_needs_every_block_released():
    pool = BlockPool(4)
    a, _ = _allocate(pool, [1] * 8)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(reversed(a))
    assert pool.reset_prefix_cache() is True
    assert pool.num_evictable_blocks == 0
