"""vLLM's prefix-cache block hash (v1, ``--prefix-caching-hash-algo sha256``, the default), in one place.

vLLM keys a full block exactly as ``app/cache/blocks.py`` does, with its own serialization::

    NONE_HASH = sha256(pickle(seed))                       seed = $PYTHONHASHSEED, else "vllm-none-hash"
    h_i       = sha256(pickle((h_{i-1} or NONE_HASH, tuple(token ids of block i), extra_keys)))
    event id  = low 64 bits of h_i, big-endian             (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default)

(``vllm/v1/core/kv_cache_utils.py``: ``init_none_hash``, ``hash_block_tokens``, ``maybe_convert_block_hash``;
``vllm/utils/hashing.py``: ``sha256`` pickles with ``pickle.HIGHEST_PROTOCOL``). The chain carries the full 32-byte
digest; only the events shorten it. ``extra_keys`` is None for a plain text request (no LoRA, salt or images).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from app.cache.blocks import hash_request_tokens

DEFAULT_SEED = "vllm-none-hash"
HASH_ALGO = "sha256"  # the only algorithm mirrored here (``cache_config_info``'s ``prefix_caching_hash_algo``)


def sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@lru_cache(maxsize=8)
def none_hash(seed: str | None = None) -> bytes:
    """The parent of a request's first block: sha256 of the pickled seed (the engine's ``PYTHONHASHSEED`` if it
    had one set, else vLLM's fixed default)."""
    return sha256_pickle(DEFAULT_SEED if seed is None else seed)


def external(block_hash: bytes) -> int:
    """The id a KV event carries for a block: the digest's low 64 bits, big-endian."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class VllmBlockHasher:
    """``hash_block(parent, token_ids, extra_keys)`` for ``app.cache.blocks.hash_request_tokens``: vLLM's recipe
    under one seed."""

    def __init__(self, seed: str | None = None) -> None:
        self.root = none_hash(seed)

    def __call__(self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        return sha256_pickle((self.root if parent is None else parent, tuple(int(t) for t in token_ids), extra_keys))

    def request(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        """The event ids of every full block of a request, first block first (the chain: ``hash_request_tokens``)."""
        return [external(h) for h in hash_request_tokens(token_ids, block_size, None, hash_block=self)]
