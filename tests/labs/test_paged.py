"""The paged lab's byte reservation, against the pool it builds."""

from __future__ import annotations

from app.cache.paged_decode import PagedEngine
from app.labs.paged import PagedLab


def test_a_multi_group_pool_reserves_the_bytes_its_tensors_hold(family_models):
    """The paged lab reserves a pool's bytes before building it (``PagedLab.pool_bytes``, from the layers' specs):
    for every family they are the K/V tensors the pool then allocates, a block holding one group's layers (the tiny
    Gemma 3: 1 layer of 3, not all 3)."""
    for lm in family_models.values():
        engine = PagedEngine(lm, num_blocks=10, block_size=4)
        tensors = {id(t): t for t in engine.cache.key_cache + engine.cache.value_cache}.values()
        held = sum(t.numel() * t.element_size() for t in tensors)
        assert PagedLab.pool_bytes(lm, 10, 4) == held == 10 * engine.cache.bytes_per_block
    gemma = family_models["gemma3"].adapter
    assert PagedLab.pool_bytes(family_models["gemma3"], 10, 4) == 10 * 2 * 1 * 4 * gemma.n_kv_head * gemma.head_dim * 4
