"""View data for the prefix-cache lab: presets, aligned tokens, block rows, the pool strip, stats.

Pure functions: request records and pool state in, plain dicts out. Nothing here runs the model or
changes the pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from app.cache.blocks import BlockPool
from app.cache.prefix import PRESETS, PrefixCache, PrefixRequest, auto_block_size
from app.i18n import DEFAULT_LANG, translate
from app.viz.tokens import honest_text, honest_texts, visible


class PrefixLabState(Protocol):
    """What a view reads of one browser's prefix lab (``app.labs.prefix.PrefixLab``)."""

    cache: PrefixCache | None
    totals: Any
    last_run: list[int]
    notes: list[tuple[str, dict]]

    @property
    def requests(self) -> Mapping[int, PrefixRequest]: ...  # read-only, so the lab's OrderedDict is one


def short_hash(h: str | None, n: int = 6) -> str:
    return h[:n] if h else "—"


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def best_earlier_match(req: PrefixRequest, earlier: list[PrefixRequest]) -> tuple[int, int | None]:
    """(length, request id) of the longest common token prefix with any earlier request of the same
    model and salt (another salt's blocks can never be shared, however alike the tokens)."""
    best, who = 0, None
    for other in earlier:
        if other.salt != req.salt:
            continue
        n = common_prefix_len(req.token_ids, other.token_ids)
        if n > best:
            best, who = n, other.request_id
    return best, who


def alignment_rows(requests: list[PrefixRequest], texts: dict[int, list[str]]) -> list[dict]:
    """One row per request, one cell per position, so equal positions line up in columns.

    Cell kinds: ``hit`` (K/V taken from the cache), ``common`` (same token as an earlier request but
    recomputed: it sits in the block holding the first difference, or in the partial tail),
    ``diff`` (the first differing token: where reuse stops), ``new`` (after it).
    """
    rows = []
    for i, req in enumerate(requests):
        lcp, who = best_earlier_match(req, requests[:i])
        hit = req.num_hit_tokens
        cells = []
        for pos, (tid, text) in enumerate(zip(req.token_ids, texts[req.request_id], strict=True)):
            if pos < hit:
                kind = "hit"
            elif pos < lcp:
                kind = "common"
            elif pos == lcp and who is not None:
                kind = "diff"
            else:
                kind = "new"
            cells.append({"pos": pos, "id": tid, "shown": visible(text), "kind": kind,
                          "block": pos // req.block_size, "block_start": pos % req.block_size == 0})
        rows.append({"request_id": req.request_id, "group": req.group, "cells": cells, "common_prefix": lcp,
                     "match": who, "first_diff": lcp if who is not None and lcp < req.num_tokens else None,
                     "hit_tokens": hit})
    return rows


def block_rows(requests: list[PrefixRequest], pool: BlockPool, cached) -> list[dict]:
    """Each request's blocks: hit or computed, hash and parent hash (shortened), live ref count.

    ``cached(hash, block_id)`` says whether that block still holds that hash (it may have been evicted).
    """
    rows = []
    for req in requests:
        blocks = []
        n_full = len(req.block_hashes)
        for i, block_id in enumerate(req.block_ids):
            lo = i * req.block_size
            hi = min(lo + req.block_size, req.num_tokens)
            full = i < n_full
            h = req.block_hashes[i] if full else None
            kind = "hit" if i < req.num_hit_blocks else ("computed" if full else "partial")
            still = bool(full and cached(h, block_id))
            running = req.status == "running"
            blocks.append({
                "index": i, "block_id": block_id, "kind": kind, "tokens": f"{lo}–{hi - 1}", "n_tokens": hi - lo,
                "hash": short_hash(h), "parent": short_hash(req.block_hashes[i - 1]) if i and full else
                ("root" if full else "—"),
                "ref_cnt": pool.blocks[block_id].ref_cnt if running and block_id >= 0 else None,
                "state": ("held" if running else ("cached" if still else ("evicted" if full else "freed"))),
                "newly_cached": bool(full and i < len(req.newly_cached) and req.newly_cached[i]),
            })
        rows.append({"request_id": req.request_id, "group": req.group, "status": req.status, "blocks": blocks})
    return rows


def pool_strip(pool: BlockPool) -> list[dict]:
    """Every physical block: used (held by a running request), evictable (cached, ref 0, with its rank
    in the eviction order, 1 = next to go) or empty."""
    rank = {b.block_id: i + 1 for i, b in enumerate(pool.eviction_order())}
    out = []
    for b in pool.blocks:
        if b.ref_cnt > 0:
            st = "used"
        elif b.block_id in rank:
            st = "evictable"
        else:
            st = "empty"
        out.append({"block_id": b.block_id, "state": st, "ref_cnt": b.ref_cnt, "lru_rank": rank.get(b.block_id),
                    "hash": short_hash(b.block_hash)})
    return out


def rate(num: int, den: int) -> float:
    return num / den if den else 0.0


def counts_view(requests: list[PrefixRequest]) -> dict:
    n = len(requests)
    hit_req = sum(1 for r in requests if r.num_hit_blocks)
    tokens = sum(r.num_tokens for r in requests)
    hit_tokens = sum(r.num_hit_tokens for r in requests)
    return {"requests": n, "requests_hit": hit_req, "request_hit_rate": rate(hit_req, n), "tokens": tokens,
            "hit_tokens": hit_tokens, "token_hit_rate": rate(hit_tokens, tokens), "tokens_saved": hit_tokens,
            "ms_reuse": sum(r.prefill_ms_reuse for r in requests), "ms_full": sum(r.prefill_ms_full for r in requests)}


def request_row(req: PrefixRequest, token_text) -> dict:
    return {
        "request_id": req.request_id, "group": req.group, "status": req.status, "salt": req.salt,
        "tokens": req.num_tokens, "hit_blocks": req.num_hit_blocks, "hit_tokens": req.num_hit_tokens,
        "group_hit_blocks": req.group_hit_blocks,  # per KV-cache group: the cached blocks it read
        "computed_tokens": req.num_computed_tokens, "hit_rate": rate(req.num_hit_tokens, req.num_tokens),
        "ms_reuse": round(req.prefill_ms_reuse, 2), "ms_full": round(req.prefill_ms_full, 2),
        "max_abs_diff": req.max_abs_diff, "same_next_token": req.next_token_reuse == req.next_token_full,
        "next_token": req.next_token_reuse, "next_token_text": visible(token_text(req.next_token_reuse)),
        "text": req.text,
    }


def lab_view(lab: PrefixLabState, lang: str = DEFAULT_LANG) -> dict:
    """Everything the page and the JSON API show about the lab's current state."""
    cache = lab.cache
    notes = [translate(key, lang, **params) for key, params in lab.notes]
    if cache is None:
        return {"empty": True, "notes": notes}
    lm, pool = cache.lm, cache.pool
    run = [lab.requests[i] for i in lab.last_run if i in lab.requests]
    texts = {r.request_id: honest_texts(lm, r.token_ids) for r in run}
    groups: dict[str, list[PrefixRequest]] = {}
    for r in run:
        groups.setdefault(r.group, []).append(r)
    evictable = pool.num_evictable_blocks
    return {
        "empty": False,
        "notes": notes,
        "config": {"model": lm.name, "block_size": cache.block_size, "num_blocks": pool.num_blocks,
                   "page_bytes": cache.page_bytes, "store_bytes": cache.page_bytes * pool.num_blocks,
                   "max_positions": lm.max_positions, "n_layer": cache.kv.group_size,  # layers one block holds
                   "kv_cache_groups": len(cache.kv.groups),
                   "n_kv_head": lm.adapter.n_kv_head, "head_dim": lm.adapter.head_dim,
                   "dtype_bytes": lm.adapter.dtype.itemsize},
        "pool": {"used": pool.num_used_blocks, "evictable": evictable, "empty": pool.num_free_blocks - evictable,
                 "free": pool.num_free_blocks, "evictions": pool.num_evictions, "blocks": pool_strip(pool)},
        "run": counts_view(run),
        "groups": [{"group": g, **counts_view(rs)} for g, rs in groups.items()],
        "totals": {**lab.totals.__dict__, "request_hit_rate": rate(lab.totals.requests_hit, lab.totals.requests),
                   "token_hit_rate": rate(lab.totals.hit_tokens, lab.totals.tokens),
                   "tokens_saved": lab.totals.hit_tokens},
        "requests": [request_row(r, lambda i: honest_text(lm, i)) for r in run],
        "alignment": alignment_rows(run, texts),
        "block_rows": block_rows(run, pool, cache.is_cached),
        "max_len": max((r.num_tokens for r in run), default=0),
    }


def presets_view(models: list | tuple = ()) -> list[dict]:
    """Each preset's prompts and, per model, their token counts, whether they fit, and the auto block size."""
    out = []
    for name, pairs in PRESETS.items():
        per_model = {}
        for lm in models:
            counts = [len(lm.encode(text)) for _, text in pairs]
            unk = lm.tokenizer.unk_token_id
            known = unk is None or all(unk not in lm.encode(text) for _, text in pairs)
            per_model[lm.name] = {"tokens": counts, "fits": known and max(counts) <= lm.max_positions,
                                  "auto_block_size": auto_block_size(counts)}
        out.append({"name": name, "groups": list(dict.fromkeys(g for g, _ in pairs)),
                    "prompts": [{"group": g, "text": t} for g, t in pairs], "models": per_model})
    return out
