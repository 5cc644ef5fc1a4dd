"""vLLM's block hash recipe, computed by KVScope through app/cache/blocks.py's chain."""

from __future__ import annotations

import hashlib
import pickle

from app.cache.blocks import hash_block_tokens, hash_request_tokens
from app.engine.hashing import DEFAULT_SEED, VllmBlockHasher, external, none_hash

# Recorded from a real vLLM 0.32 (CPU, block size 32, no PYTHONHASHSEED): the BlockStored event for "The cat sat on
# the mat. " × 12 on SmolLM2 (85 tokens) carried these two hashes (REFERENCE.md). test_real_engine.py checks the same
# recipe against a live engine on every preset.
CAT_IDS = [504] + [2644, 2643, 335, 260, 1171, 30, 378] * 12
CAT_HASHES = [14190140100120519301, 8167213292747257693]


def test_the_recipe_reproduces_hashes_a_real_vllm_published():
    assert VllmBlockHasher().request(CAT_IDS, 32) == CAT_HASHES


def test_each_block_is_sha256_of_the_pickled_triple_chained_through_the_full_digest():
    root = hashlib.sha256(pickle.dumps(DEFAULT_SEED, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert none_hash() == root
    h0 = hashlib.sha256(pickle.dumps((root, tuple(CAT_IDS[:32]), None), protocol=5)).digest()
    h1 = hashlib.sha256(pickle.dumps((h0, tuple(CAT_IDS[32:64]), None), protocol=5)).digest()
    assert [external(h0), external(h1)] == CAT_HASHES
    assert external(h1) == int.from_bytes(h1[-8:], "big")  # the low 64 bits, big-endian


def test_a_seed_changes_every_hash_and_the_default_chain_is_unchanged():
    assert VllmBlockHasher("0").request(CAT_IDS, 32) != CAT_HASHES
    ours = hash_request_tokens(CAT_IDS, 32)
    assert ours == [hash_block_tokens(None, CAT_IDS[:32]), hash_block_tokens(ours[0], CAT_IDS[32:64])]
    assert len(VllmBlockHasher().request(CAT_IDS[:31], 32)) == 0  # no full block, no hash
