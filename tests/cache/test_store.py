"""The KV-store contract: every store the labs use satisfies ``KVStore``, and ``nbytes`` counts what it holds."""

from __future__ import annotations

import pytest
import torch

from app.cache.paged import PagedKVCache
from app.cache.policies import POLICIES, bytes_held, kept_positions, make_store
from app.cache.store import FloatKVStore, KeepsPositions, KVStore, PagedSeqStore
from app.cache.window import WindowKVStore


def feed(store, n_layer: int, n_kv_head: int, head_dim: int, tokens: int) -> None:
    """One step of ``tokens`` new tokens, as forward_through drives it (k, v: (H_kv, T, Dh))."""
    store.begin(tokens)
    for layer in range(n_layer):
        k = torch.randn(n_kv_head, tokens, head_dim)
        store.attend_kv(layer, k, -k)
    store.end(tokens)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_store_satisfies_the_protocol(tiny, name):
    store = make_store(name, tiny.adapter, budget=8)
    assert isinstance(store, KVStore)


def test_the_plain_and_paged_stores_satisfy_the_protocol():
    cache = PagedKVCache(num_blocks=4, block_size=2, n_layer=1, n_kv_head=1, head_dim=2)
    assert isinstance(FloatKVStore(1), KVStore) and isinstance(PagedSeqStore(cache, 0), KVStore)
    assert not isinstance(object(), KVStore)


def test_nbytes_counts_what_each_store_holds():
    L, H, Dh, fp32 = 2, 3, 4, 4
    per_token = 2 * L * H * Dh * fp32  # K and V, every layer: derived by hand
    plain = FloatKVStore(L)
    feed(plain, L, H, Dh, 5)
    assert plain.nbytes == bytes_held(plain) == 5 * per_token
    cache = PagedKVCache(num_blocks=8, block_size=4, n_layer=L, n_kv_head=H, head_dim=Dh)
    paged = PagedSeqStore(cache, 0)
    feed(paged, L, H, Dh, 5)
    assert paged.nbytes == 2 * 4 * per_token  # two whole blocks of 4 slots (3 slots of tail waste)
    window = WindowKVStore(8, n_layer=L, n_kv_head=H, head_dim=Dh)
    feed(window, L, H, Dh, 5)
    assert window.nbytes == 5 * per_token  # 5 of 8 slots filled
    feed(window, L, H, Dh, 6)
    assert window.nbytes == 8 * per_token  # full: the last 8 tokens


def test_kept_positions_asks_the_store_or_gives_every_position():
    window = WindowKVStore(3, n_layer=1, n_kv_head=2, head_dim=2)
    assert isinstance(window, KeepsPositions) and not isinstance(FloatKVStore(1), KeepsPositions)
    feed(window, 1, 2, 2, 5)
    assert kept_positions(window, 0, 2).tolist() == [[2, 3, 4]] * 2
    plain = FloatKVStore(1)
    feed(plain, 1, 2, 2, 4)
    assert kept_positions(plain, 0, 2).tolist() == [[0, 1, 2, 3]] * 2
