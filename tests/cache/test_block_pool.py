"""The one block pool, two layouts: ``BlockPool`` (objects) and ``ArrayBlockPool`` (arrays) under random
workloads. Both keep vLLM's invariants after every call, and both make exactly the same decisions."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.cache.blocks import (
    ArrayBlockPool,
    BlockPool,
    NoFreeBlocks,
    block_extra_keys,
    blocks_needed,
    hash_request_tokens,
)

EXTRA = block_extra_keys("m", None)
BS = 2


def block_id(block) -> int:
    return block if isinstance(block, int) else block.block_id


class Manager:
    """A miniature kv_cache_manager over either pool: get_computed_blocks -> allocate_slots -> free."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.requests: dict[int, list] = {}
        self.log: list = []  # every decision, as block ids, to compare the two layouts

    def allocate(self, rid: int, tokens: list[int]) -> None:
        pool = self.pool
        hashes = hash_request_tokens(tokens, BS, EXTRA)
        hits = pool.find_longest_cache_hit(hashes, (len(tokens) - 1) // BS)
        need = blocks_needed(len(tokens), BS) - len(hits)
        evictable_hits = sum(1 for b in hits if _ref(pool, b) == 0)
        if need + evictable_hits > pool.num_free_blocks:
            with pytest.raises(NoFreeBlocks):
                pool.get_new_blocks(pool.num_free_blocks + 1)
            self.log.append(("full", rid))
            return
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(need)
        for i in range(len(hits), len(hashes)):
            pool.cache_full_block(blocks[i], hashes[i])
        self.requests[rid] = blocks
        self.log.append(("alloc", rid, len(hits), [block_id(b) for b in blocks]))

    def free(self, rid: int) -> None:
        self.pool.free_blocks(reversed(self.requests.pop(rid)))
        self.log.append(("free", rid, [block_id(b) for b in self.pool.eviction_order()]))


def _ref(pool, block) -> int:
    return pool.ref_cnt[block] if isinstance(pool, ArrayBlockPool) else block.ref_cnt


def check_invariants(m: Manager) -> None:
    pool = m.pool
    held = Counter(block_id(b) for blocks in m.requests.values() for b in blocks)
    free_ids = [block_id(b) for b in (pool.free_block_queue if isinstance(pool, ArrayBlockPool)
                                      else pool.free_block_queue.blocks())]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert pool.num_used_blocks == pool.num_blocks - pool.num_free_blocks == len(held)
    for b in range(pool.num_blocks):
        ref = pool.ref_cnt[b] if isinstance(pool, ArrayBlockPool) else pool.blocks[b].ref_cnt
        assert ref == held.get(b, 0)  # ref_cnt = the running requests that hold the block
        assert (ref == 0) == (b in free_ids)  # in the free queue exactly when nobody holds it
    for h, b in pool.cached_block_hash_to_block.items():  # the map and the blocks' hashes agree
        stored = pool.block_hash[b] if isinstance(pool, ArrayBlockPool) else b.block_hash
        assert stored == h
    assert pool.num_evictable_blocks == len(pool.eviction_order()) <= pool.num_free_blocks
    if not pool.enable_caching:
        assert pool.cached_block_hash_to_block == {}


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.lists(st.integers(0, 2), min_size=1, max_size=9)),
        st.tuples(st.just("free"), st.integers(0, 30)),
    ),
    max_size=40,
)


def replay(pool, program) -> Manager:
    m = Manager(pool)
    for rid, (op, arg) in enumerate(program):
        if op == "alloc":
            m.allocate(rid, arg)
        elif m.requests:
            m.free(sorted(m.requests)[arg % len(m.requests)])
        check_invariants(m)
    return m


@settings(max_examples=150, deadline=None)
@given(program=ops, num_blocks=st.integers(1, 8), caching=st.booleans())
def test_both_layouts_keep_the_invariants_and_make_the_same_decisions(program, num_blocks, caching):
    objects = replay(BlockPool(num_blocks, enable_caching=caching), program)
    arrays = replay(ArrayBlockPool(num_blocks, enable_caching=caching), program)
    assert objects.log == arrays.log
    assert objects.pool.num_evictions == arrays.pool.num_evictions


@pytest.mark.parametrize("layout", [BlockPool, ArrayBlockPool])
def test_lru_eviction_order_under_a_small_capacity(layout):
    """The scenario of test_blocks.py, on both layouts: A and B finished, C needs 2 of 4 blocks."""
    m = Manager(layout(4))
    m.allocate(0, [1] * 4)  # blocks 0 1 (block size 2)
    m.allocate(1, [2] * 4)  # blocks 2 3
    m.free(0)
    m.free(1)
    assert [block_id(b) for b in m.pool.eviction_order()] == [1, 0, 3, 2]
    m.allocate(2, [3] * 4)
    assert [block_id(b) for b in m.requests[2]] == [1, 0] and m.pool.num_evictions == 2


@pytest.mark.parametrize("layout", [BlockPool, ArrayBlockPool])
def test_without_caching_the_pool_is_a_fifo_of_free_blocks(layout):
    pool = layout(3, enable_caching=False)
    a = pool.get_new_blocks(2)
    assert pool.cache_full_block(a[0], "h") is False and pool.find_longest_cache_hit(["h"]) == []
    pool.free_blocks(reversed(a))  # 1 then 0 go to the back
    assert [block_id(b) for b in pool.get_new_blocks(3)] == [2, 1, 0]


@pytest.mark.parametrize("layout", [BlockPool, ArrayBlockPool])
def test_freeing_more_often_than_taken_is_refused(layout):
    pool = layout(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])


def test_blocks_needed_is_the_ceiling():
    assert [blocks_needed(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
