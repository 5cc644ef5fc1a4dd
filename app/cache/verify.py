"""The verification bench: one prompt, greedy decoding, every cache compared with full recompute step by step.

Paths compared (the article's method: full recompute, contiguous cache, paged cache, quantized caches; plus
the sliding window):

    full        the model's own forward over the whole prefix at every step, no cache (the reference)
    contiguous  the model's own forward with a transformers DynamicCache, one new token per step
    paged       ``forward_through`` reading K/V through a ``PagedKVCache`` block table
    int8-head, int8-block, fp8-e4m3, int4-head   ``forward_through`` over a quantized cache
    window      ``forward_through`` over a cyclic buffer of the last W tokens

The reference chooses the tokens (greedy). Every other path is fed those same tokens, so its per-step
max |Δlogits| measures the cache alone, not a different history; the token it *would* choose is recorded,
and its first divergent step is the first step where that token differs from the reference's. (Left to
run on its own choices, a path's output differs completely from that step on.)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from app.cache.blocks import blocks_needed
from app.cache.paged import PagedKVCache
from app.cache.paged_decode import forward_through
from app.cache.quant import FORMATS, QuantizedKVStore, float_bytes_per_token
from app.cache.store import KVStore, PagedSeqStore
from app.cache.window import WindowKVStore
from app.model.loading import LoadedModel

QUANT_PATHS = tuple(FORMATS)


def path_names(window: int) -> list[str]:
    return ["full", "contiguous", "paged", *QUANT_PATHS, f"window-{window}"]


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    """K and V bytes transformers' own cache holds: every layer an attention layer that has seen the tokens."""
    total = 0
    for layer in cache.layers:
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None:
            raise TypeError(f"a {type(layer).__name__} holds no keys to count")
        total += 2 * layer.keys.numel() * layer.keys.element_size()
    return total


@torch.no_grad()
def run_bench(
    lm: LoadedModel, ids: list[int], *, steps: int, block_size: int = 16, window: int = 8,
    lock: AbstractContextManager | None = None,
) -> dict:
    """``steps`` rows, one per generated token: step 0 is the prefill's prediction, step s the s-th decode step
    (the arena counts the same way). Each row: every path's logits error and the token it would choose."""
    a = lm.adapter
    guard = lock or nullcontext()
    if len(ids) + steps - 1 > a.max_positions:  # the last step reads positions 0 .. len(ids) + steps - 2
        raise ValueError("prompt + steps exceed the model's positions")
    model = lm.model
    names = path_names(window)
    paged = PagedKVCache(num_blocks=blocks_needed(len(ids) + steps - 1, block_size), block_size=block_size,
                         n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim, dtype=a.dtype)
    stores: dict[str, KVStore] = {"paged": PagedSeqStore(paged, 0)}
    stores |= {f: QuantizedKVStore(f, n_layer=a.n_layer, block_size=block_size) for f in QUANT_PATHS}
    stores[names[-1]] = WindowKVStore(window, n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim)
    dyn = DynamicCache(config=model.config)

    prefix = list(ids)
    feed = list(ids)  # what the cached paths process this step: the prompt, then one token at a time
    rows: list[dict[str, Any]] = []
    for step in range(steps):
        with guard:
            ref = model(input_ids=torch.tensor([prefix])).logits[0, -1]  # (V,)
            out = model(input_ids=torch.tensor([feed]), cache=dyn, use_cache=True)
            dyn = out.cache
            logits = {"full": ref, "contiguous": out.logits[0, -1]}
            for name, store in stores.items():
                logits[name] = forward_through(lm, store, feed)[-1]
        chosen = int(ref.argmax())
        cells = {}
        for name in names:
            token = int(logits[name].argmax())
            cells[name] = {"max_abs_diff": float((logits[name] - ref).abs().max()), "token": token,
                           "same": token == chosen}
        rows.append({"step": step, "position": len(prefix) - 1, "token": chosen, "cells": cells})
        prefix.append(chosen)
        feed = [chosen]

    first = {n: next((r["step"] for r in rows if not r["cells"][n]["same"]), None) for n in names}
    worst = {n: max(r["cells"][n]["max_abs_diff"] for r in rows) for n in names}
    shape = {"n_layer": a.n_layer, "n_kv_head": a.n_kv_head, "head_dim": a.head_dim}
    fp32 = float_bytes_per_token(**shape)
    bytes_per_token = {"full": 0.0, "contiguous": float(fp32), "paged": float(fp32), names[-1]: float(fp32)}
    bytes_per_token |= {f: FORMATS[f].bytes_per_token(**shape, block_size=block_size) for f in QUANT_PATHS}
    held = {n: stores[n].nbytes for n in ("paged", *QUANT_PATHS, names[-1])}
    held["contiguous"] = dynamic_cache_bytes(dyn)
    held["full"] = 0
    return {
        "prompt_ids": list(ids), "steps": steps, "block_size": block_size, "window": window, "paths": names,
        "rows": rows, "first_divergence": first, "max_abs_diff": worst, "bytes_per_token": bytes_per_token,
        "bytes_held": held, "tokens": prefix,
    }
