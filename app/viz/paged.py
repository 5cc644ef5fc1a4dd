"""View data for the /paged page: the block pool map, block tables, capacity, the verification bench.

Pure functions: engine or bench result in, plain JSON-ready data out. No tensors leave this module.
"""

from __future__ import annotations

from typing import Any, cast

from app.cache.blocks import blocks_needed
from app.cache.paged import NULL_BLOCK
from app.cache.paged_decode import PagedEngine
from app.cache.quant import FORMATS, float_bytes_per_token
from app.i18n import DEFAULT_LANG, translate
from app.kv_bytes import bytes_per_token
from app.model.loading import LoadedModel
from app.viz.tokens import honest_text, honest_texts, visible


def _text(lm: LoadedModel, ids: list[int]) -> str:
    # one sequence of ids decodes to one string (transformers types decode's result str | list[str])
    return cast(str, lm.tokenizer.decode(ids, clean_up_tokenization_spaces=False))


def pool_view(engine: PagedEngine) -> dict:
    """Every physical block: who holds it, its ref count, how many of its slots are written, the tokens in them."""
    cache, lm = engine.cache, engine.lm
    bs = cache.block_size
    holders: dict[int, list[tuple[int, int, int]]] = {}  # block id -> [(seq id, logical block index, group)]
    for g, seq_id, table in cache.tables_of_all():
        for j, block_id in enumerate(table):
            if block_id != NULL_BLOCK:
                holders.setdefault(block_id, []).append((seq_id, j, g))
    free_order = {b: i for i, b in enumerate(cache.free_block_queue)}
    blocks = []
    for block in cache.blocks:
        held = holders.get(block.block_id, [])
        entry: dict[str, Any] = {"id": block.block_id, "ref_cnt": block.ref_cnt, "owners": [s for s, _, _ in held],
                 "filled": 0, "slots": [], "free_pos": free_order.get(block.block_id),
                 "group": held[0][2] if held else None}
        if held:
            seq_id, j, _ = held[0]
            ids = engine.sequences[seq_id].tokens[j * bs : (j + 1) * bs]
            entry["filled"] = len(ids)
            entry["slots"] = [visible(t) for t in honest_texts(lm, ids)]
        entry["waste"] = bs - entry["filled"] if held else 0
        blocks.append(entry)
    return {"blocks": blocks, "num_blocks": cache.num_blocks, "block_size": bs,
            "free": cache.num_free_blocks, "used": cache.num_used_blocks, "bytes_per_block": cache.bytes_per_block,
            "bytes_total": cache.bytes_per_block * cache.num_blocks, "cow_copies": cache.cow_copies,
            "groups": groups_view(engine), "window_frees": cache.window_frees}


def groups_view(engine: PagedEngine) -> list[dict]:
    """The KV-cache groups (one per kind of layer and size, as vLLM's hybrid allocator makes them): which layers,
    their window, and the blocks their tables hold now (shared blocks once), with the most one sequence holds."""
    cache = engine.cache
    rows = []
    for g, group in enumerate(cache.groups):
        held = {b for seq in cache.tables[g] for b in cache.held_blocks(seq, g)}
        most = max((len(cache.held_blocks(seq, g)) for seq in cache.tables[g]), default=0)
        rows.append({"group": g, "kind": group.kind, "window": group.window, "layers": list(group.layers),
                     "blocks": len(held), "most_per_seq": most,
                     "cap": None if group.window is None else blocks_needed(group.window, cache.block_size) + 1})
    return rows


def sequences_view(engine: PagedEngine, lang: str = DEFAULT_LANG) -> list[dict]:
    lm, cache = engine.lm, engine.cache
    rows = []
    for seq in engine.sequences.values():
        table = cache.block_tables.get(seq.seq_id, [])
        tables = cache.seq_tables(seq.seq_id) if table else []
        rows.append({
            "id": seq.seq_id, "status": seq.status, "status_text": translate(f"status.{seq.status}", lang),
            "parent": seq.parent,
            "prompt": _text(lm, seq.tokens[: seq.prompt_len]),
            "generated_text": _text(lm, seq.tokens[seq.prompt_len :]),
            "next": visible(honest_text(lm, seq.pending)) if seq.pending is not None else None,
            "cached_tokens": cache.num_tokens.get(seq.seq_id, 0), "block_table": list(table),
            # every group's table when layers differ (None where a window freed the block)
            "group_tables": [[None if b == NULL_BLOCK else b for b in t] for t in tables] if len(tables) > 1 else [],
            "tail_waste": cache.tail_waste(seq.seq_id) if table else 0,
            "generated": seq.generated, "max_new": seq.max_new,
            "preemptions": seq.preemptions, "recomputed_tokens": seq.recomputed_tokens,
            "can_fork": seq.status == "running" and bool(seq.alternatives),
        })
    return rows


def capacity_view(
    *, n_layer: int, n_kv_head: int, head_dim: int, budget_bytes: int, lengths: list[int],
    block_sizes: tuple[int, ...],
) -> dict:
    """For the pool's memory budget: tokens that fit per block size, and the tail waste the given sequences cause.

    ``lengths`` are the token counts of the sequences now in the pool, each counted as if it held its blocks
    alone (sharing after a fork is ignored here).
    """
    per_token = float_bytes_per_token(n_layer=n_layer, n_kv_head=n_kv_head, head_dim=head_dim)
    rows = []
    for bs in block_sizes:
        block_bytes = per_token * bs
        num_blocks = budget_bytes // block_bytes
        needed = sum(blocks_needed(n, bs) for n in lengths)
        waste = needed * bs - sum(lengths)
        rows.append({
            "block_size": bs, "block_bytes": block_bytes, "num_blocks": num_blocks, "tokens": num_blocks * bs,
            "blocks_needed": needed, "waste_slots": waste, "waste_bytes": waste * per_token,
            "waste_pct": 100.0 * waste / (needed * bs) if needed else 0.0, "max_waste_per_seq": bs - 1,
        })
    bf16 = bytes_per_token(n_layer=n_layer, n_kv_head=n_kv_head, head_dim=head_dim, dtype="bf16")
    formats = [{"name": "fp32", "bytes_per_token": per_token, "tokens": budget_bytes // per_token},
               {"name": "bf16", "bytes_per_token": bf16, "tokens": budget_bytes // bf16}]
    for fmt in FORMATS.values():
        b = fmt.bytes_per_token(n_layer=n_layer, n_kv_head=n_kv_head, head_dim=head_dim, block_size=16)
        formats.append({"name": fmt.name, "bytes_per_token": b, "tokens": int(budget_bytes // b)})
    return {"budget_bytes": budget_bytes, "bytes_per_token": per_token, "lengths": list(lengths),
            "by_block_size": rows, "by_format": formats}


def event_text(event: tuple[str, dict], lang: str = DEFAULT_LANG) -> str:
    """One log entry, a (catalog key, parameters) pair, as a sentence in ``lang``."""
    key, params = event
    return translate(key, lang, **params)


def stall_view(stall: dict | None, lang: str = DEFAULT_LANG) -> dict | None:
    """The stall, with the sentence that says it (admission: the waiting sequence; growth: the blocked ones)."""
    if stall is None:
        return None
    if stall["kind"] == "admit":
        text = translate("ev.stall.admit", lang, seq=stall["seq_id"], needed=stall["needed"], free=stall["free"])
    else:
        text = translate("ev.stall.grow", lang, seqs=stall["blocked"], needed=stall["needed"], free=stall["free"])
    return {**stall, "text": text}


def engine_view(engine: PagedEngine, session_id: str, lang: str, *, block_sizes: tuple[int, ...]) -> dict:
    """Everything the page draws. The event log and the stall are catalog keys in the engine, sentences here.
    ``block_sizes``: the sizes the capacity table compares (the lab's, ``Settings.block_sizes``)."""
    a = engine.lm.adapter
    cache = engine.cache
    lengths = [cache.num_tokens[s] for s in cache.block_tables]
    reserved = cache.num_used_blocks * cache.block_size
    stored = sum(lengths)
    return {
        "session": session_id, "model": engine.lm.name, "step": engine.step_count,
        "pool": pool_view(engine), "sequences": sequences_view(engine, lang), "waiting": list(engine.waiting),
        "stall": stall_view(engine.stall, lang), "events": [event_text(e, lang) for e in engine.events],
        "summary": {"tokens_stored": stored, "slots_reserved": reserved,
                    "tail_waste": sum(cache.tail_waste(s) for s in cache.block_tables)},
        "capacity": capacity_view(n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim,
                                  budget_bytes=cache.bytes_per_block * cache.num_blocks, lengths=lengths,
                                  block_sizes=block_sizes),
    }


def path_label(name: str, window: int, lang: str = DEFAULT_LANG) -> str:
    """A verification-bench path's name for people: ``bench.path.<name>`` in the catalog."""
    return translate(f"bench.path.{name}", lang, window=window) if name in PATHS else \
        translate("bench.path.window", lang, window=window)


PATHS = ("full", "contiguous", "paged", "int8-head", "int8-block", "fp8-e4m3", "int4-head")


def bench_view(lm: LoadedModel, result: dict, lang: str = DEFAULT_LANG) -> dict:
    """The bench table: one row per step, per path max |Δlogits| vs full recompute and the token it would pick."""
    paths = result["paths"]
    first = result["first_divergence"]
    rows = []
    for row in result["rows"]:
        cells = []
        for name in paths:
            c = row["cells"][name]
            cells.append({"path": name, "diff": c["max_abs_diff"], "token": c["token"],
                          "text": visible(honest_text(lm, c["token"])), "same": c["same"],
                          "first": first[name] == row["step"]})
        rows.append({"step": row["step"], "position": row["position"], "token": row["token"],
                     "text": visible(honest_text(lm, row["token"])), "cells": cells})
    return {
        "model": lm.name, "prompt": _text(lm, result["prompt_ids"]), "steps": result["steps"],
        "block_size": result["block_size"], "window": result["window"],
        "paths": [{"name": n, "label": path_label(n, result["window"], lang),
                   "first_divergence": first[n], "max_abs_diff": result["max_abs_diff"][n],
                   "bytes_per_token": result["bytes_per_token"][n], "bytes_held": result["bytes_held"][n]}
                  for n in paths],
        "rows": rows, "generated": _text(lm, result["tokens"][len(result["prompt_ids"]) :]),
    }
