"""The prefix cache over real K/V: reuse must equal computing from scratch, on both test models."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from app.cache.paged_decode import PagedSeqStore
from app.cache.prefix import PRESETS, PrefixCache, auto_block_size
from app.errors import BadInput, NotFound
from app.viz.prefix import common_prefix_len

SYSTEM = "you are a kind helper. answer in one short line and keep it plain.\n"


@torch.no_grad()
def from_scratch(lm, ids):
    """Independent path: one plain forward over every token, fresh cache."""
    model = lm.model
    return model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=model.config), use_cache=True)


@pytest.mark.parametrize("fixture, block_size", [("distil", 4), ("tiny", 16)])
def test_reuse_equals_from_scratch(request, fixture, block_size):
    lm = request.getfixturevalue(fixture)
    cache = PrefixCache(lm, block_size=block_size, num_blocks=32)
    a = lm.encode(SYSTEM + "user. what does a cache keep.\n")
    b = lm.encode(SYSTEM + "user. why are old keys kept.\n")
    cache.prefill(a, request_id=1)
    hashes, (hits,) = cache.get_computed_blocks(b, None)  # one KV-cache group: every layer alike
    # The hit length, derived from the tokens alone: whole blocks of the common prefix.
    lcp = common_prefix_len(a, b)
    assert len(hits) * block_size == min(lcp // block_size, (len(b) - 1) // block_size) * block_size
    assert len(hits) >= 2

    # Reuse by hand: a sequence with the hits attached reads their stored K/V; only the rest is computed.
    n_hit = len(hits) * block_size
    cache.kv.attach(99, [hits])
    reused = lm.adapter.forward_through(PagedSeqStore(cache.kv, 99), b[n_hit:])
    cache.kv.free(99)
    full = from_scratch(lm, b)
    ref = full.logits[0, n_hit:]
    assert (reused - ref).abs().max().item() <= 1e-4
    assert reused[-1].argmax() == ref[-1].argmax()

    # And through the cache's own prefill: what the page shows.
    req = cache.prefill(b, request_id=2)
    assert req.num_hit_blocks == len(hits)
    assert req.max_abs_diff <= 1e-4
    assert req.next_token_reuse == req.next_token_full == int(full.logits[0, -1].argmax())

    # Every block the request holds stores exactly the from-scratch K/V of its positions.
    for i, block_id in enumerate(req.block_ids):
        lo, hi = i * block_size, min((i + 1) * block_size, len(b))
        for layer in range(lm.adapter.n_layer):
            k, v = lm.adapter.layer_cache(full.cache, layer)  # (1, H, T, Dh)
            assert torch.allclose(cache.kv.key_cache[layer][block_id, :, : hi - lo], k[0, :, lo:hi], atol=1e-5)
            assert torch.allclose(cache.kv.value_cache[layer][block_id, :, : hi - lo], v[0, :, lo:hi], atol=1e-5)


def test_partial_tail_block_is_computed_not_shared(tiny):
    cache = PrefixCache(tiny, block_size=16, num_blocks=16)
    ids = tiny.encode(SYSTEM)  # 67 characters: 4 full blocks + a tail of 3
    assert len(ids) == 67
    r1 = cache.prefill(ids, request_id=1)
    assert len(r1.block_hashes) == 4 and len(r1.block_ids) == 5
    assert r1.newly_cached == [True] * 4
    assert cache.pool.blocks[r1.block_ids[-1]].block_hash is None
    r2 = cache.prefill(ids, request_id=2)
    assert r2.num_hit_blocks == 4 and r2.num_computed_tokens == 3
    assert r2.block_ids[:4] == r1.block_ids[:4] and r2.block_ids[4] != r1.block_ids[4]
    assert [cache.pool.blocks[i].ref_cnt for i in r2.block_ids] == [2, 2, 2, 2, 1]


def test_a_fully_cached_prompt_still_computes_its_last_block(tiny):
    cache = PrefixCache(tiny, block_size=16, num_blocks=16)
    ids = tiny.encode(SYSTEM[:64])  # exactly 4 blocks
    cache.prefill(ids, request_id=1)
    again = cache.prefill(ids, request_id=2)
    assert again.num_hit_blocks == 3 and again.num_computed_tokens == 16
    assert again.newly_cached[-1] is False  # its hash is already held by request 1's block
    assert again.max_abs_diff <= 1e-4


def test_release_on_finish_and_cancel(tiny, prefix_lab):
    lab = prefix_lab
    prompts = [("g", SYSTEM + "user. hi.\n"), ("g", SYSTEM + "user. so.\n")]
    r1, r2 = lab.run(tiny, prompts, block_size=16, num_blocks=32)
    pool = lab.cache.pool
    assert pool.num_used_blocks == len(r1.block_ids) + len(r2.block_ids) - r2.num_hit_blocks
    lab.finish(r2.request_id, reason="cancelled")
    assert r2.status == "cancelled"
    assert [pool.blocks[i].ref_cnt for i in r1.block_ids] == [1] * len(r1.block_ids)
    lab.finish(r1.request_id)
    assert r1.status == "finished" and pool.num_used_blocks == 0
    assert pool.num_evictable_blocks == len(r1.block_hashes) + len(r2.block_hashes) - r2.num_hit_blocks
    lab.finish(r1.request_id)  # twice is harmless
    assert pool.num_used_blocks == 0
    with pytest.raises(NotFound):
        lab.finish(999)


def test_cancelled_mid_prefill_frees_blocks_and_caches_nothing(tiny, monkeypatch):
    cache = PrefixCache(tiny, block_size=16, num_blocks=16)
    ids = tiny.encode(SYSTEM)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("client went away")

    monkeypatch.setattr(cache.kv, "write_kv", boom)  # the forward fails after its blocks were taken
    with pytest.raises(KeyboardInterrupt):
        cache.prefill(ids, request_id=1)
    assert cache.pool.num_used_blocks == 0
    assert cache.pool.cached_block_hash_to_block == {}
    monkeypatch.undo()
    assert cache.prefill(ids, request_id=2).num_hit_blocks == 0


def test_lru_eviction_on_real_kv(tiny, prefix_lab):
    """5 blocks of 16 tokens; A, B, C are 32 tokens each (2 full blocks, no tail). A and B finish
    (each tail first), then C takes the one empty block and the least recently used one: A's tail."""
    lab = prefix_lab
    a, b, c = "the cat sat on the mat. the dog ", "we keep the keys and values in a", "a new token asks a query. old to"
    assert all(len(tiny.encode(t)) == 32 for t in (a, b, c))
    (ra,) = lab.run(tiny, [("x", a)], block_size=16, num_blocks=5)
    (rb,) = lab.run(tiny, [("x", b)], block_size=16, num_blocks=5)  # finishes A first
    lab.finish()
    pool = lab.cache.pool
    assert [x.block_id for x in pool.eviction_order()] == [ra.block_ids[1], ra.block_ids[0],
                                                           rb.block_ids[1], rb.block_ids[0]]
    (rc,) = lab.run(tiny, [("x", c)], block_size=16, num_blocks=5)
    assert pool.num_evictions == 1 and ra.block_ids[1] in rc.block_ids
    cache = lab.cache
    assert len(cache.get_computed_blocks(tiny.encode(a + "c"), None)[1][0]) == 1  # A's head survived
    assert len(cache.get_computed_blocks(tiny.encode(b + "c"), None)[1][0]) == 2  # B untouched


def test_cache_full_is_a_clear_message(tiny, prefix_lab):
    lab = prefix_lab
    with pytest.raises(BadInput, match="cache is full"):
        lab.run(tiny, [("x", SYSTEM), ("y", "the dog sat on the log. " * 3)], block_size=16, num_blocks=6)
    assert lab.cache.pool.num_used_blocks == 5  # the first request is still running, nothing leaked


def test_salt_and_model_keep_caches_apart(tiny, prefix_lab):
    lab = prefix_lab
    (r1,) = lab.run(tiny, [("x", SYSTEM + "a.")], block_size=16, num_blocks=32, salt="alice")
    (r2,) = lab.run(tiny, [("x", SYSTEM + "a.")], block_size=16, num_blocks=32, salt="bob")
    (r3,) = lab.run(tiny, [("x", SYSTEM + "a.")], block_size=16, num_blocks=32, salt="alice")
    assert (r1.num_hit_blocks, r2.num_hit_blocks, r3.num_hit_blocks) == (0, 0, 4)


def test_presets_fit_both_models(distil, tiny):
    for name, prompts in PRESETS.items():
        for _, text in prompts:
            assert len(tiny.encode(text)) <= tiny.max_positions, name
            assert 0 not in tiny.encode(text), f"{name}: a character the tiny model does not know"


def test_auto_block_size():
    assert auto_block_size([97, 100]) == 16
    assert auto_block_size([26, 33]) == 4
    assert auto_block_size([40]) == 8
    assert auto_block_size([5]) == 4


def test_unknown_characters_are_refused_for_the_char_model(tiny, prefix_lab):
    with pytest.raises(BadInput, match="does not know"):
        prefix_lab.run(tiny, [("x", "Current time: 10:42 🙂")], block_size=16)


def test_change_of_block_size_starts_a_new_cache(tiny, prefix_lab):
    lab = prefix_lab
    lab.run(tiny, [("x", SYSTEM)], block_size=16, num_blocks=32)
    lab.run(tiny, [("x", SYSTEM)], block_size=8, num_blocks=32)
    assert lab.cache.block_size == 8 and lab.notes and len(lab.requests) == 1


def test_gemma3_reuse_needs_every_groups_blocks_and_equals_from_scratch(family_models):
    """The tiny Gemma 3 (layers 0, 1: a window of 8; layer 2 full) caches in three KV-cache groups. After A, a
    request B sharing a prefix longer than the window hits in every group: the full group all of the common prefix's
    blocks, each sliding group only the ceil((W - 1) / bs) blocks its first computed query reads (the ones before are
    null, never read again). B's logits are transformers' own from-scratch forward's."""
    from app.cache.blocks import group_block_hash
    from app.cache.paged import NULL_BLOCK
    from tests.shaped_model import GEMMA3_WINDOW

    lm = family_models["gemma3"]
    bs = 4
    cache = PrefixCache(lm, block_size=bs, num_blocks=64)
    assert [g.window for g in cache.kv.groups] == [None, GEMMA3_WINDOW, GEMMA3_WINDOW]
    a = lm.encode(SYSTEM + "user. what does a cache keep.\n")
    b = lm.encode(SYSTEM + "user. why are old keys kept.\n")
    lcp = common_prefix_len(a, b)
    assert lcp > 2 * GEMMA3_WINDOW
    ra = cache.prefill(a, request_id=1)
    # A's local groups gave back what fell outside the window, still cached (evictable), so B can find it.
    assert all(t[0] == NULL_BLOCK for t in cache.kv.seq_tables(1)[1:])
    n_blocks = min(lcp // bs, (len(b) - 1) // bs)  # whole blocks of the common prefix, >= 1 token left to compute
    window_blocks = -(-(GEMMA3_WINDOW - 1) // bs)  # cover the W - 1 keys before B's first computed query
    hashes, hits = cache.get_computed_blocks(b, None)
    assert [len(h) for h in hits] == [n_blocks] * 3
    assert all(blk is not None for blk in hits[0])  # the full group: every block of the prefix
    for g in (1, 2):  # a local group: nulls, then the blocks cached under this group's keys
        assert hits[g][: n_blocks - window_blocks] == [None] * (n_blocks - window_blocks)
        for i in range(n_blocks - window_blocks, n_blocks):
            assert hits[g][i] is cache.pool.cached_block_hash_to_block[group_block_hash(hashes[i], g)]
    rb = cache.prefill(b, request_id=2)
    assert rb.num_hit_blocks == n_blocks and rb.group_hit_blocks == [n_blocks, window_blocks, window_blocks]
    assert ra.max_abs_diff <= 1e-4
    # Reuse vs from scratch: the same fp32 arithmetic over K/V read back from blocks, summed in another order and
    # shape (the hits' keys are not recomputed) -> fp32 rounding, ~1e-6 relative; 1e-4 on logits of size ~10.
    full = from_scratch(lm, b)
    assert rb.max_abs_diff <= 1e-4
    assert rb.next_token_reuse == rb.next_token_full == int(full.logits[0, -1].argmax())
    # Every block B's full group holds stores transformers' from-scratch K/V of its positions.
    k_full, _ = lm.adapter.layer_cache(full.cache, 2)  # (1, H, T, Dh)
    k_ours, _ = cache.kv.gather_kv(2, 2)
    assert torch.allclose(k_ours, k_full[0], atol=1e-5)
    # A local layer still holds its window: transformers' cache keeps the last W - 1 of them.
    k_local, _ = lm.adapter.layer_cache(full.cache, 0)
    assert torch.allclose(cache.kv.gather_kv(2, 0)[0][:, -(GEMMA3_WINDOW - 1):], k_local[0], atol=1e-5)
    # The pool's books: every block's ref count is the number of table entries that point at it.
    refs: dict[int, int] = {}
    for _, _, table in cache.kv.tables_of_all():
        for blk in table:
            if blk != NULL_BLOCK:
                refs[blk] = refs.get(blk, 0) + 1
    assert all(blk.ref_cnt == refs.get(blk.block_id, 0) for blk in cache.pool.blocks)
