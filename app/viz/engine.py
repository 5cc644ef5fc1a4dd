"""View data for the Engine page: a real engine's mirrored blocks, its status, metrics and configuration, the fleet's
chains and a prompt's route, and a drive's comparison, as plain dicts worded in the page's language.

Pure functions: the engine mirror's records (``app/engine/``: the mirror, its metrics, the fleet's indexes, a drive's
steps) in, plain dicts out. Nothing here talks to an engine or takes a lock: the lab (``app/labs/engine.py``) copies
what a view reads under the link's lock, or calls the view under it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from itertools import islice
from typing import Protocol

from app import catalog
from app.capacity.calculator import VLLM_CACHE_DTYPES, engine_capacity
from app.engine.drive import Drive
from app.engine.fleet import Chain, EngineIndex, Score, decide
from app.engine.hashing import HASH_ALGO
from app.engine.metrics import EngineMetrics, finite
from app.engine.mirror import BlockMirror
from app.errors import BadInput
from app.i18n import translate

STATUS_OK = "engine.status.ok"
CONFIG_SHOWN = ("block_size", "num_gpu_blocks", "kv_cache_memory_bytes", "kv_cache_size_tokens",
                "kv_cache_max_concurrency", "prefix_caching_hash_algo", "cache_dtype", "enable_prefix_caching",
                "sliding_window")
CHANGES_SHOWN = 30  # the newest mirror changes a snapshot carries (the page's "as it happens" feed)


class LinkState(Protocol):
    """What a view reads of one engine's link (``app.engine.link.EngineLink``): its names, its health, its mirror."""

    url: str
    events: str | None
    mirror: BlockMirror
    http_status: tuple[str, dict] | None
    events_connected: bool
    event_errors: int
    last_event_error: tuple[str, dict, int | None, int | None] | None
    thread_failures: dict[str, int]
    last_thread_failure: tuple[str, str] | None
    texts_dropped: int
    texts_failed: int

    @property
    def texts_pending(self) -> int: ...


def hex_id(h: int | None) -> str | None:
    """A block hash as the page shows it: 16 hex digits (vLLM's 64-bit external id)."""
    return None if h is None else f"{h:016x}"


def _finite(value: object) -> object:
    """``value`` with every float that is not finite as None (JSON has no NaN or infinity)."""
    if isinstance(value, float):
        return finite(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def json_line(view: dict) -> bytes:
    """One NDJSON line that any JSON parser reads: never NaN or Infinity, whatever slipped through."""
    try:
        text = json.dumps(view, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(view), allow_nan=False)
    return (text + "\n").encode()


def status_lines(link: LinkState, lang: str, *, most_pending_texts: int) -> list[dict]:
    """What is wrong or worth saying, most important first (each a sentence in ``lang``); ``ok`` when nothing."""
    out = []

    def say(level: str, key: str, **params) -> None:
        out.append({"level": level, "key": key, "text": translate(key, lang, **params)})

    if link.http_status is not None:
        say("error" if link.http_status[0].startswith("err.") else "info", link.http_status[0], **link.http_status[1])
    if link.events and not link.events_connected:
        say("error", "err.engine.events_unreachable", endpoint=link.events)
    if not link.events:
        say("info", "engine.status.no_events", url=link.url)
    for side, n in sorted(link.thread_failures.items()):  # each failure is in the server's log, with its trace
        why = link.last_thread_failure[1] if link.last_thread_failure else "?"
        say("warn", f"engine.status.{side}_restarted", n=n, why=why)
    if link.last_event_error is not None:
        key, params, seq, event = link.last_event_error
        why = translate(key, lang, **params)
        if seq is None:  # not even a sequence number could be read
            say("warn", "err.engine.bad_frames", n=link.event_errors, why=why)
        elif event is None:
            say("warn", "err.engine.bad_batch", n=link.event_errors, seq=seq, why=why)
        else:
            say("warn", "err.engine.bad_event", n=link.event_errors, seq=seq, event=event, why=why)
    if link.texts_dropped:
        say("info", "engine.status.texts_dropped", n=link.texts_dropped, most=most_pending_texts)
    m = link.mirror
    if m.gaps:
        say("warn", "engine.status.gaps", n=len(m.gaps), missing=sum(b - a + 1 for a, b in m.gaps),
            first=m.gaps[0][0], last=m.gaps[0][1])
    if m.restarts:
        say("info", "engine.status.restarted", n=m.restarts)
    if not out:
        say("ok", STATUS_OK, batches=m.batches, replayed=m.replayed)
    return out


def snapshot_view(index: int, link: LinkState, lang: str, *, streams: int, max_shown: int,
                  most_pending_texts: int) -> dict:
    """Engine ``index`` as its mirror holds it: counts, groups, media, gaps, the newest ``max_shown`` blocks (oldest
    first) and the newest changes. Read under the link's lock (the event thread changes the mirror)."""
    m = link.mirror
    shown = list(islice(reversed(m.blocks.values()), max_shown))[::-1]
    blocks = [{"hash": hex_id(b.block_hash), "parent": hex_id(b.parent), "group": b.group_idx, "medium": b.medium,
               "kind": b.spec_kind, "window": b.sliding_window, "tokens": len(b.token_ids), "text": b.text,
               "seq": b.seq} for b in shown]
    changes = list(islice(reversed(m.changes), CHANGES_SHOWN))[::-1]
    return {"index": index, "url": link.url, "events": link.events, "version": m.version,
            "status": status_lines(link, lang, most_pending_texts=most_pending_texts),
            "connected": link.events_connected,
            "counts": {"held": len(m.blocks), "shown": len(blocks), "stored": m.stored, "removed": m.removed,
                       "cleared": m.cleared, "batches": m.batches, "replayed": m.replayed, "dropped": m.dropped,
                       "unknown_removed": m.unknown_removed, "next_seq": m.next_seq, "streams": streams,
                       "skipped": link.event_errors, "texts_pending": link.texts_pending,
                       "texts_dropped": link.texts_dropped, "texts_failed": link.texts_failed},
            "groups": [{"group": g, "kind": k, "window": w, "held": sum(n for (hg, _), n in m.held.items() if hg == g)}
                       for g, (k, w) in sorted(m.groups.items())],
            "media": sorted({med for _, med in m.held}),
            "gaps": [{"first": a, "last": b} for a, b in m.gaps],
            "block_size": m.block_size, "blocks": blocks,
            "changes": [{**c, "hash": hex_id(c.get("hash")), "parent": hex_id(c.get("parent"))} for c in changes]}


def metrics_view(metrics: EngineMetrics | None, log: Sequence[tuple[float, EngineMetrics]], now: float, *,
                 stopped: bool = False) -> dict | None:
    """The engine's counters as the page shows them; the recent hit rate over the last minute of ``log`` (oldest
    first: (time, scrape)) up to ``now``: Δ hits ÷ Δ queries. ``stopped``: the engine no longer answers its scrape
    (stopped, crashed, unreachable), so these are its last figures, from the scrape that last worked ``stale_s``
    seconds ago (the page counts on from there)."""
    m = metrics
    if m is None:
        return None
    stale_s = now - log[-1][0] if log and stopped else None
    before = None
    for t, old in log:
        if t >= now - 60:
            before = old
            break
    return {"usage": m.usage, "queries": m.prefix_queries, "hits": m.prefix_hits,
            "hit_rate": m.hit_rate_since(None), "hit_rate_recent": m.hit_rate_since(before),
            "running": m.running, "waiting": m.waiting, "ttft_mean_s": m.ttft_mean_s, "ttft_count": m.ttft_count,
            "itl_mean_s": m.itl_mean_s, "itl_count": m.itl_count, "stale_s": stale_s,
            "config": {k: m.config.get(k) for k in CONFIG_SHOWN}}


def catalog_model(card: Mapping[str, str | None] | None) -> catalog.ModelConfig | None:
    """The catalog's entry for an engine's model (its ``/v1/models`` card: matched on its served name or the path it
    loaded; the longest key that matches)."""
    if card is None:
        return None
    names = " ".join(card[k] or "" for k in ("id", "root")).lower()
    best = [m for m in catalog.CATALOG.values() if m.key in names or m.hf_id.split("/")[-1].lower() in names]
    return max(best, key=lambda m: len(m.key)) if best else None


def calculator_line(metrics: EngineMetrics | None, model: catalog.ModelConfig | None, context: object, *,
                    max_block_size: int, batched_tokens: int) -> dict | None:
    """KVScope's calculator on the engine's own configuration (its model, KV memory, block size, cache dtype and
    max model length ``context``), counted as vLLM counts (``engine_capacity``: blocks of its KV-cache groups), beside
    the engine's ``cache_config_info``. ``{"model": None}`` when something it needs is unknown or not a number the
    formula can take (no model in the catalog, no KV memory reported, an unknown cache dtype)."""
    m = metrics
    if m is None:
        return None
    bs, mem = m.config_int("block_size"), m.config_int("kv_cache_memory_bytes")
    dtype = VLLM_CACHE_DTYPES.get(str(m.config.get("cache_dtype", "auto")))
    if model is None or dtype is None or not isinstance(bs, int) or not isinstance(mem, int) \
            or not isinstance(context, int) or min(bs, mem, context) <= 0 or bs > max_block_size:
        return {"model": None}
    try:
        calc = engine_capacity(model, dtype=dtype, block_size=bs, kv_memory_bytes=mem, max_model_len=context,
                               max_num_batched_tokens=batched_tokens)
    except BadInput:  # a configuration the calculator does not take
        return {"model": None}
    theirs_conc = m.config_float("kv_cache_max_concurrency")  # finite or None: a figure, and JSON
    return {"model": model.name, "dtype": dtype, "context": context, "block_size": bs, "kv_memory_bytes": mem,
            "groups": calc["groups"], "group_size": calc["group_size"], "block_bytes": calc["block_bytes"],
            "windowed": calc["windowed"], "batched_tokens": batched_tokens,
            "ours": {k: calc[k] for k in ("num_blocks", "tokens", "max_concurrency", "blocks_per_request")},
            "theirs": {"num_blocks": m.config_int("num_gpu_blocks"), "tokens": m.config_int("kv_cache_size_tokens"),
                       "max_concurrency": theirs_conc}}


def fleet_view(indexes: Sequence[tuple[EngineIndex, bool | None]], links: Sequence[LinkState],
               chains: Sequence[Chain], total: int) -> dict:
    """Which engine holds which prefix: one row per engine (its index, ``links[i]``'s names, whether its hashes are
    reproducible here) and one per chain of cached blocks with how deep each engine holds it."""
    return {"engines": [{"index": ix.index, "url": link.url, "events": link.events, "block_size": ix.block_size,
                         "hash_algo": ix.hash_algo, "usage": ix.usage, "held": len(ix.blocks),
                         "reproducible": ok, "connected": link.events_connected}
                        for (ix, ok), link in zip(indexes, links, strict=True)],
            "chains": [{"blocks": len(c.hashes), "tokens": c.tokens, "from_start": c.from_start,
                        "first": hex_id(c.hashes[0]), "last": hex_id(c.hashes[-1]), "texts": c.texts,
                        "held": [c.held.get(i, 0) for i in range(len(links))]} for c in chains],
            "total": total}


def route_row(index: int, url: str, ix: EngineIndex, reproducible: bool | None) -> dict:
    """An engine's row of a route, before it is scored."""
    return {"index": index, "url": url, "block_size": ix.block_size, "hash_algo": ix.hash_algo, "usage": ix.usage,
            "held": len(ix.blocks), "reproducible": reproducible}


def unroutable(ix: EngineIndex, lang: str) -> str | None:
    """Why a prompt cannot be scored against this engine's index (in ``lang``), or None when it can."""
    if ix.hash_algo not in (None, HASH_ALGO):
        return translate("err.engine.hash_algo", lang, algo=ix.hash_algo, ours=HASH_ALGO)
    if not ix.block_size:
        return translate("engine.fleet.no_size", lang)
    return None


def scored_row(row: dict, s: Score) -> None:
    """``row`` with the engine's score for the prompt."""
    row.update(tokens=s.tokens, blocks=s.blocks, matched=s.matched, matched_tokens=s.matched_tokens, reused=s.reused,
               hit_tokens=s.hit_tokens)


def route_view(rows: list[dict], scores: Sequence[Score], urls: Sequence[str], lang: str) -> dict:
    """The router's pick among the scored engines (``decide``: the highest score, a tie broken by KV usage, then
    index), and its verdict in ``lang``."""
    d = decide(scores, {r["index"]: r["usage"] for r in rows})
    if d.pick is None:
        verdict = translate("engine.fleet.nobody", lang)
    elif len(d.tied) > 1:
        verdict = translate("engine.fleet.tie", lang, engines=", ".join(str(i) for i in d.tied),
                            tokens=d.best_tokens, pick=d.pick)
    else:
        verdict = translate("engine.fleet.pick", lang, engine=d.pick, url=urls[d.pick], tokens=d.best_tokens)
    return {"rows": rows, "pick": d.pick, "tied": list(d.tied), "best_tokens": d.best_tokens, "verdict": verdict}


def drive_view(preset: str, url: str, drive: Drive, lang: str) -> dict:
    """A drive's comparison, request by request: KVScope's prediction beside what the engine reported, the totals,
    and the first difference (in ``lang``)."""
    rows: list[dict] = []
    first = None
    for i, step in enumerate(drive.steps):
        pred, obs, diff = step.predicted, step.observed, step.difference
        if first is None and diff is not None:
            first = {"key": diff[0], "text": translate(diff[0], lang, **diff[1])}
        rows.append({"request": i + 1, "group": step.group, "group_text": translate(f"prefix.group.{step.group}", lang),
                     "tokens": len(step.token_ids), "blocks": len(pred.hashes),
                     "latency_s": step.latency_s, "text": step.text, "completion": step.completion,
                     "ours": {"hit_blocks": pred.hit_blocks, "hit_tokens": pred.hit_tokens,
                              "stored": len(pred.stored), "evicted": pred.evicted,
                              "hashes": [hex_id(h) for h in pred.stored]},
                     "theirs": {"hit_tokens": obs.hits, "queries": obs.queries, "stored": len(obs.stored),
                                "evicted": obs.removed, "hashes": [hex_id(h) for h in obs.stored]},
                     "same": diff is None})
    totals = {side: {k: sum(r[side][k] for r in rows) for k in ("stored", "evicted", "hit_tokens")}
              for side in ("ours", "theirs")}
    queries = sum(r["tokens"] for r in rows)
    for side in totals:
        totals[side]["hit_rate"] = totals[side]["hit_tokens"] / queries if queries else None
    return {"preset": preset, "engine": url, "block_size": drive.block_size, "num_blocks": drive.num_blocks,
            "held_before": drive.held_before, "gaps_before": drive.gaps_before, "rows": rows, "totals": totals,
            "first_difference": first, "same": first is None}

