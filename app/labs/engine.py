"""The Engine lab (/engine): a real serving engine's KV cache, live, beside KVScope's own engine.

``EngineLab`` owns one ``EngineLink`` per engine named in the settings (``KVSCOPE_ENGINE``, ``KVSCOPE_ENGINE_EVENTS``;
``kvscope serve --engine … --engine-events …``), started with the server and stopped with it. No request can add an
engine or name an address: a page picks an engine by its index among those configured.

    page()                          what the page renders first (engines configured, or how to start one)
    snapshot(i, lang)               engine i's status, metrics, config line, calculator line, blocks as a tree
    stream(i, since)                NDJSON: a snapshot whenever the mirror changes (and every poll), bounded in time
    drive(i, preset, owner)         send a preset's requests to engine i, and the same through KVScope's own pool
    fleet(lang)                     the fleet: which engine holds which prefix (chains of blocks, decoded)
    route(prompt, lang)             the fleet: where a new prompt would find the most cached blocks

Drive runs one at a time per engine (its lock; a second one gets Busy); each browser's last comparison is kept
(the newest ``engine_max_runs_kept`` browsers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import islice

from app import catalog
from app.cache.prefix import PRESETS, scaled_presets
from app.capacity.calculator import VLLM_CACHE_DTYPES, engine_capacity
from app.engine.compare import Observed, Predictor, first_difference
from app.engine.fleet import EngineIndex, IndexBlock, decide, fleet_chains, score
from app.engine.hashing import HASH_ALGO, VllmBlockHasher, external
from app.engine.link import EngineDown, EngineLink, LinkLimits
from app.engine.metrics import EngineMetrics, finite
from app.errors import BadInput, Busy, NotFound
from app.i18n import translate
from app.labs.limits import Limits

PRESET_SCALE = 5  # the prefix presets' shared parts said 5 times: 80-210 SmolLM2 tokens, 2-6 blocks of 32
STATUS_OK = "engine.status.ok"
STREAM_IDLE_S = 1.0  # a waiting stream looks again after this long even unwoken (its end time, a missed wake)
STREAM_MIN_GAP_S = 0.1  # at most ten lines a second to one page, however fast the engine publishes


def replay_endpoint(events: str, configured: str | None) -> str | None:
    """The replay socket: the configured one, else the events port + 1 (how ``kvscope engine`` starts vLLM)."""
    if configured:
        return configured
    if events.startswith("tcp://"):
        host, port = events.rsplit(":", 1)
        return f"{host}:{int(port) + 1}"
    return None


@dataclass(frozen=True)
class EngineLimits(Limits):
    """The engines named at start-up (their URLs, event and replay endpoints: nothing a request can change) and the
    mirror's, stream's and drive's bounds."""

    GROUP = "engine"
    engine: tuple[str, ...]
    engine_events: tuple[str, ...]
    engine_replay: tuple[str, ...]
    engine_poll_s: float
    engine_http_timeout_s: float
    engine_replay_timeout_s: float
    engine_max_blocks: int
    engine_max_changes: int
    engine_stream_max_s: float
    engine_max_shown_blocks: int
    engine_drive_max_requests: int
    engine_drive_timeout_s: float
    engine_max_num_batched_tokens: int
    engine_max_runs_kept: int
    engine_fleet_max_chains: int
    max_prompt_chars: int
    engine_max_block_size: int
    engine_max_tokens: int
    engine_max_message_mib: int
    engine_max_pending_texts: int
    engine_max_streams: int
    engine_drive_max_blocks: int


def links_from(limits: EngineLimits) -> list[EngineLink]:
    link_limits = LinkLimits(poll_s=limits.engine_poll_s, http_timeout_s=limits.engine_http_timeout_s,
                             replay_timeout_s=limits.engine_replay_timeout_s, max_blocks=limits.engine_max_blocks,
                             max_changes=limits.engine_max_changes, max_tokens=limits.engine_max_tokens,
                             max_block_size=limits.engine_max_block_size,
                             max_message_bytes=limits.engine_max_message_mib * 2**20,
                             max_pending_texts=limits.engine_max_pending_texts, max_streams=limits.engine_max_streams,
                             stream_max_s=limits.engine_stream_max_s)
    out = []
    for i, url in enumerate(limits.engine):
        events = limits.engine_events[i] if i < len(limits.engine_events) else None
        replay = limits.engine_replay[i] if i < len(limits.engine_replay) else None
        out.append(EngineLink(name=f"engine {i}", url=url, events=events,
                              replay=replay_endpoint(events, replay) if events else None, limits=link_limits))
    return out


def _hex(h: int | None) -> str | None:
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


class EngineLab:
    def __init__(self, *, limits: EngineLimits, links: list[EngineLink] | None = None) -> None:
        self.limits = limits
        self.links = links_from(limits) if links is None else links
        self._drive_locks = [threading.Lock() for _ in self.links]
        self.runs: OrderedDict[str, dict] = OrderedDict()  # owner -> last comparison
        self._runs_lock = threading.Lock()

    def start(self) -> None:
        for link in self.links:
            link.start()

    def stop(self) -> None:
        for link in self.links:
            link.stop()

    def link(self, index: int) -> EngineLink:
        if not 0 <= index < len(self.links):
            raise NotFound("err.engine.no_engine", index=index, n=len(self.links))
        return self.links[index]

    # --- views ------------------------------------------------------------------------------------------------
    def page(self, lang: str) -> dict:
        return {"configured": bool(self.links), "presets": list(PRESETS),
                "engines": [{"index": i, "url": ln.url, "events": ln.events, "replay": ln.replay_endpoint}
                            for i, ln in enumerate(self.links)],
                "max_shown": self.limits.engine_max_shown_blocks}

    def status(self, link: EngineLink, lang: str) -> list[dict]:
        """What is wrong or worth saying, most important first (each a sentence in ``lang``); ``ok`` when nothing."""
        out = []

        def say(level: str, key: str, **params) -> None:
            out.append({"level": level, "key": key, "text": translate(key, lang, **params)})

        if link.http_status is not None:
            say("error" if link.http_status[0].startswith("err.") else "info", link.http_status[0],
                **link.http_status[1])
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
            say("info", "engine.status.texts_dropped", n=link.texts_dropped, most=link.limits.max_pending_texts)
        m = link.mirror
        if m.gaps:
            say("warn", "engine.status.gaps", n=len(m.gaps), missing=sum(b - a + 1 for a, b in m.gaps),
                first=m.gaps[0][0], last=m.gaps[0][1])
        if m.restarts:
            say("info", "engine.status.restarted", n=m.restarts)
        if not out:
            say("ok", STATUS_OK, batches=m.batches, replayed=m.replayed)
        return out

    def metrics_view(self, link: EngineLink) -> dict | None:
        with link.lock:  # the HTTP thread appends to the log: it is read as a copy, taken under the lock
            m, log, down = link.metrics, tuple(link.metrics_log), link.http_status
        if m is None:
            return None
        # The engine no longer answers its scrape (stopped, crashed, unreachable): these are its last figures, from
        # the scrape that last worked, that many seconds ago (the page counts on from there).
        stale_s = time.time() - log[-1][0] if log and down is not None and down[0].startswith("err.") else None
        before = None
        for t, old in log:  # the rate over the last minute: Δ hits ÷ Δ queries
            if t >= time.time() - 60:
                before = old
                break
        return {"usage": m.usage, "queries": m.prefix_queries, "hits": m.prefix_hits,
                "hit_rate": m.hit_rate_since(None), "hit_rate_recent": m.hit_rate_since(before),
                "running": m.running, "waiting": m.waiting, "ttft_mean_s": m.ttft_mean_s, "ttft_count": m.ttft_count,
                "itl_mean_s": m.itl_mean_s, "itl_count": m.itl_count, "stale_s": stale_s,
                "config": {k: m.config.get(k) for k in ("block_size", "num_gpu_blocks", "kv_cache_memory_bytes",
                                                        "kv_cache_size_tokens", "kv_cache_max_concurrency",
                                                        "prefix_caching_hash_algo", "cache_dtype",
                                                        "enable_prefix_caching", "sliding_window")}}

    def calculator_line(self, link: EngineLink) -> dict | None:
        """KVScope's calculator on the engine's own configuration (its model, KV memory, block size, cache dtype and
        max model length), counted as vLLM counts (``engine_capacity``: blocks of its KV-cache groups), beside the
        engine's ``cache_config_info``. ``{"model": None}`` when something it needs is unknown or not a number the
        formula can take (no model in the catalog, no KV memory reported, an unknown cache dtype)."""
        m = link.metrics
        if m is None:
            return None
        model = self.engine_model(link)
        bs, mem = m.config_int("block_size"), m.config_int("kv_cache_memory_bytes")
        try:
            context = link.model_card()["max_model_len"]
        except EngineDown:
            context = None
        dtype = VLLM_CACHE_DTYPES.get(str(m.config.get("cache_dtype", "auto")))
        if model is None or dtype is None or not all(isinstance(x, int) and x > 0 for x in (bs, mem, context)) \
                or bs > self.limits.engine_max_block_size:
            return {"model": None}
        batched = self.limits.engine_max_num_batched_tokens
        try:
            calc = engine_capacity(model, dtype=dtype, block_size=bs, kv_memory_bytes=mem, max_model_len=context,
                                   max_num_batched_tokens=batched)
        except BadInput:  # a configuration the calculator does not take
            return {"model": None}
        theirs_conc = m.config_float("kv_cache_max_concurrency")  # finite or None: a figure, and JSON
        return {"model": model.name, "dtype": dtype, "context": context, "block_size": bs, "kv_memory_bytes": mem,
                "groups": calc["groups"], "group_size": calc["group_size"], "block_bytes": calc["block_bytes"],
                "windowed": calc["windowed"], "batched_tokens": batched,
                "ours": {k: calc[k] for k in ("num_blocks", "tokens", "max_concurrency", "blocks_per_request")},
                "theirs": {"num_blocks": m.config_int("num_gpu_blocks"), "tokens": m.config_int("kv_cache_size_tokens"),
                           "max_concurrency": theirs_conc}}

    def engine_model(self, link: EngineLink) -> catalog.ModelConfig | None:
        """The catalog's entry for the engine's model (matched on its served name or the path it loaded)."""
        try:
            card = link.model_card()
        except EngineDown:
            return None
        names = " ".join(card[k] or "" for k in ("id", "root")).lower()
        best = [m for m in catalog.CATALOG.values() if m.key in names or m.hf_id.split("/")[-1].lower() in names]
        return max(best, key=lambda m: len(m.key)) if best else None

    def snapshot(self, index: int, lang: str) -> dict:
        link = self.link(index)
        streams = link.streams  # pages following it now (taken before the lock: it takes the lock itself)
        with link.lock:
            m = link.mirror
            shown = list(islice(reversed(m.blocks.values()), self.limits.engine_max_shown_blocks))[::-1]
            blocks = [{"hash": _hex(b.block_hash), "parent": _hex(b.parent), "group": b.group_idx, "medium": b.medium,
                       "kind": b.spec_kind, "window": b.sliding_window, "tokens": len(b.token_ids), "text": b.text,
                       "seq": b.seq} for b in shown]
            view = {"index": index, "url": link.url, "events": link.events, "version": m.version,
                    "status": self.status(link, lang), "connected": link.events_connected,
                    "counts": {"held": len(m.blocks), "shown": len(blocks), "stored": m.stored, "removed": m.removed,
                               "cleared": m.cleared, "batches": m.batches, "replayed": m.replayed,
                               "dropped": m.dropped, "unknown_removed": m.unknown_removed, "next_seq": m.next_seq,
                               "streams": streams, "skipped": link.event_errors,
                               "texts_pending": link.texts_pending, "texts_dropped": link.texts_dropped,
                               "texts_failed": link.texts_failed},
                    "groups": [{"group": g, "kind": k, "window": w,
                                "held": sum(n for (hg, _), n in m.held.items() if hg == g)}
                               for g, (k, w) in sorted(m.groups.items())],
                    "media": sorted({med for _, med in m.held}),
                    "gaps": [{"first": a, "last": b} for a, b in m.gaps],
                    "block_size": m.block_size, "blocks": blocks,
                    "changes": list(islice(reversed(m.changes), 30))[::-1]}
            view["changes"] = [{**c, "hash": _hex(c.get("hash")), "parent": _hex(c.get("parent"))}
                               for c in view["changes"]]
        view["metrics"] = self.metrics_view(link)
        return view

    def stream(self, index: int, lang: str, since: int = -1) -> AsyncIterator[bytes]:
        """One JSON line per change of engine ``index``, at most one line per ``STREAM_MIN_GAP_S``, for at most
        ``engine_stream_max_s``. Waiting costs no thread: the link wakes this stream's event loop on each change
        (``EngineLink.watch``), so a change is sent at once, or as soon as the line budget allows when the last line
        went out less than ``STREAM_MIN_GAP_S`` ago (everything that changed meanwhile goes in that one line).

        Called in the event loop that will run the stream: it registers there at once, so a ``Busy`` (as many
        streams as ``engine_max_streams`` already follow this engine) is raised before any response starts."""
        link = self.link(index)
        wake = asyncio.Event()
        unwatch = link.watch(asyncio.get_running_loop(), wake)
        return self._lines(link, index, lang, since, wake, unwatch)

    async def _lines(self, link: EngineLink, index: int, lang: str, since: int, wake: asyncio.Event,
                     unwatch: Callable[[], None]) -> AsyncIterator[bytes]:
        end = time.monotonic() + self.limits.engine_stream_max_s
        last_sent, last_metrics, last_time, last_status = since, None, float("-inf"), None
        try:
            while (now := time.monotonic()) < end:
                wake.clear()
                version, metrics = link.mirror.version, link.metrics
                status = (link.http_status, link.events_connected, link.event_errors,
                          sum(link.thread_failures.values()))
                if version != last_sent or metrics is not last_metrics or status != last_status:
                    if (ready := last_time + STREAM_MIN_GAP_S - now) > 0:
                        await asyncio.sleep(ready)
                        continue
                    last_time = now
                    snap = await asyncio.to_thread(self.snapshot, index, lang)
                    yield json_line(snap)
                    last_sent, last_metrics, last_status = version, metrics, status  # read before the snapshot
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout=min(STREAM_IDLE_S, max(0.0, end - now)))
        finally:
            unwatch()

    # --- drive and compare ----------------------------------------------------------------------------------------
    def drive(self, index: int, preset: str, owner: str, lang: str) -> dict:
        """Send preset's prompts to engine ``index`` one after the other and run them through KVScope's own pool."""
        link = self.link(index)
        if preset not in PRESETS:
            raise BadInput("err.engine.preset", preset=repr(preset)[:40], presets=", ".join(PRESETS))
        lock = self._drive_locks[index]
        if not lock.acquire(blocking=False):
            raise Busy("err.engine.driving", retry_after=5)
        try:
            result = self._drive(link, preset, lang)
        finally:
            lock.release()
        with self._runs_lock:
            self.runs[owner] = result
            self.runs.move_to_end(owner)
            while len(self.runs) > self.limits.engine_max_runs_kept:
                self.runs.popitem(last=False)
        return result

    def _drive(self, link: EngineLink, preset: str, lang: str) -> dict:
        prompts = scaled_presets(PRESET_SCALE)[preset][: self.limits.engine_drive_max_requests]
        before = link.scrape()
        bs, nblocks = before.config_int("block_size"), before.config_int("num_gpu_blocks")
        algo = before.config.get("prefix_caching_hash_algo", HASH_ALGO)
        if not bs or not nblocks:
            raise Busy("err.engine.no_config", url=link.url, retry_after=5)
        if bs > self.limits.engine_max_block_size or nblocks > self.limits.engine_drive_max_blocks:
            raise BadInput("err.engine.config_range", url=link.url, size=bs, blocks=nblocks,
                           most_size=self.limits.engine_max_block_size, most_blocks=self.limits.engine_drive_max_blocks)
        if algo != HASH_ALGO:
            raise BadInput("err.engine.hash_algo", algo=algo, ours=HASH_ALGO)
        if not link.events or not link.events_connected:
            raise BadInput("err.engine.events_unreachable", endpoint=link.events or "-")
        with link.lock:
            held = tuple(b.block_hash for b in link.mirror.blocks.values() if b.group_idx == 0 and b.medium == "GPU")
            gaps = len(link.mirror.gaps)
        predictor = Predictor(num_blocks=nblocks, block_size=bs, held=held)
        rows, first = [], None
        prev = before
        for i, (group, text) in enumerate(prompts):
            ids = link.tokenize(text)
            with link.lock:
                v0 = link.mirror.version
            t0 = time.monotonic()
            # One token: the engine then caches the prompt's full blocks only (a sampled token is never computed
            # into the cache), the blocks KVScope's pool predicts from the same prompt.
            out = link.complete(text, max_tokens=1, timeout=self.limits.engine_drive_timeout_s)
            latency = time.monotonic() - t0
            pred = predictor.run(ids)
            obs, prev = self._observe(link, v0, prev, expect=len(pred.stored))
            diff = first_difference(i, pred, obs)
            if first is None and diff is not None:
                first = {"key": diff[0], "text": translate(diff[0], lang, **diff[1])}
            rows.append({"request": i + 1, "group": group, "group_text": translate(f"prefix.group.{group}", lang),
                         "tokens": len(ids), "blocks": len(pred.hashes),
                         "latency_s": latency, "text": text, "completion": out,
                         "ours": {"hit_blocks": pred.hit_blocks, "hit_tokens": pred.hit_tokens,
                                  "stored": len(pred.stored), "evicted": pred.evicted,
                                  "hashes": [_hex(h) for h in pred.stored]},
                         "theirs": {"hit_tokens": obs.hits, "queries": obs.queries, "stored": len(obs.stored),
                                    "evicted": obs.removed, "hashes": [_hex(h) for h in obs.stored]},
                         "same": diff is None})
        totals = {side: {k: sum(r[side][k] for r in rows) for k in ("stored", "evicted", "hit_tokens")}
                  for side in ("ours", "theirs")}
        queries = sum(r["tokens"] for r in rows)
        for side in totals:
            totals[side]["hit_rate"] = totals[side]["hit_tokens"] / queries if queries else None
        return {"preset": preset, "engine": link.url, "block_size": bs, "num_blocks": nblocks, "held_before": len(held),
                "gaps_before": gaps, "rows": rows, "totals": totals, "first_difference": first,
                "same": first is None}

    def _observe(self, link: EngineLink, v0: int, prev: EngineMetrics, *, expect: int,
                 settle_s: float = 0.4, wait_s: float = 5.0) -> tuple[Observed, EngineMetrics]:
        """What the engine reported for the request just finished: its events since version ``v0`` (waiting for
        ``expect`` stored blocks, then a little longer for stragglers) and its metrics' deltas."""
        deadline = time.monotonic() + wait_s
        while True:
            with link.lock:
                changes = link.mirror.changes_since(v0) or []
            stored = [c["hash"] for c in changes if c["op"] == "stored"]
            if len(stored) >= expect or time.monotonic() > deadline:
                break
            link.wait(link.mirror.version, timeout=0.2)
        time.sleep(settle_s)
        with link.lock:
            changes = link.mirror.changes_since(v0) or []
        after = link.scrape()
        obs = Observed(stored=[c["hash"] for c in changes if c["op"] == "stored"],
                       removed=sum(1 for c in changes if c["op"] == "removed"),
                       queries=(after.prefix_queries or 0) - (prev.prefix_queries or 0),
                       hits=(after.prefix_hits or 0) - (prev.prefix_hits or 0))
        return obs, after

    def last_run(self, owner: str) -> dict | None:
        with self._runs_lock:
            return self.runs.get(owner)

    # --- the fleet ----------------------------------------------------------------------------------------------
    def _index(self, i: int, link: EngineLink, medium: str = "GPU") -> tuple[EngineIndex, bool | None]:
        """Engine ``i``'s event-fed index (group 0, ``medium``) copied out under its lock, and whether its hashes are
        reproducible here: one of its first blocks (no parent) re-hashed with vLLM's default seed gives its id."""
        with link.lock:
            m, metrics = link.mirror, link.metrics
            own = [b for b in m.blocks.values() if b.group_idx == 0 and b.medium == medium]
            blocks = {b.block_hash: IndexBlock(b.block_hash, b.parent, len(b.token_ids), b.text) for b in own}
            first = next((b for b in reversed(own) if b.parent is None), None)
            bs = m.block_size
        algo = metrics.config.get("prefix_caching_hash_algo") if metrics else None
        bs = bs or (metrics.config_int("block_size") if metrics else None)
        checked = None if first is None else external(VllmBlockHasher()(None, first.token_ids)) == first.block_hash
        return EngineIndex(index=i, name=link.name, block_size=bs, hash_algo=algo,
                           usage=metrics.usage if metrics else None, blocks=blocks), checked

    def fleet(self, lang: str) -> dict:
        """Which engine holds which prefix: every engine's chains of cached blocks (from its live events), merged
        across the fleet, with the text they hold and how deep each engine holds them."""
        if not self.links:
            raise NotFound("err.engine.none")
        indexes = [self._index(i, link) for i, link in enumerate(self.links)]
        chains, total = fleet_chains([ix for ix, _ in indexes], max_chains=self.limits.engine_fleet_max_chains)
        return {"engines": [{"index": ix.index, "url": link.url, "events": link.events, "block_size": ix.block_size,
                             "hash_algo": ix.hash_algo, "usage": ix.usage, "held": len(ix.blocks),
                             "reproducible": ok, "connected": link.events_connected}
                            for (ix, ok), link in zip(indexes, self.links, strict=True)],
                "chains": [{"blocks": len(c.hashes), "tokens": c.tokens, "from_start": c.from_start,
                            "first": _hex(c.hashes[0]), "last": _hex(c.hashes[-1]), "texts": c.texts,
                            "held": [c.held.get(i, 0) for i in range(len(self.links))]} for c in chains],
                "total": total}

    def route(self, prompt: str, lang: str) -> dict:
        """Where ``prompt`` would find the most leading cached blocks, engine by engine (a KV-aware router's choice:
        ``app/engine/fleet.py``), each engine scored with its own tokenizer, block size and hash function."""
        prompt = (prompt or "").strip()
        if not prompt:
            raise BadInput("err.engine.empty_prompt")
        if len(prompt) > self.limits.max_prompt_chars:
            raise BadInput("err.engine.prompt_long", n=self.limits.max_prompt_chars)
        if not self.links:
            raise NotFound("err.engine.none")
        rows, scores = [], []
        for i, link in enumerate(self.links):
            ix, ok = self._index(i, link)
            row = {"index": i, "url": link.url, "block_size": ix.block_size, "hash_algo": ix.hash_algo,
                   "usage": ix.usage, "held": len(ix.blocks), "reproducible": ok}
            rows.append(row)
            if ix.hash_algo not in (None, HASH_ALGO):
                row["error"] = translate("err.engine.hash_algo", lang, algo=ix.hash_algo, ours=HASH_ALGO)
                continue
            if not ix.block_size:
                row["error"] = translate("engine.fleet.no_size", lang)
                continue
            try:
                ids = link.tokenize(prompt)
            except EngineDown as exc:
                row["error"] = translate(exc.key, lang, **exc.params)
                continue
            s = score(ix, ids, VllmBlockHasher().request(ids, ix.block_size))
            scores.append(s)
            row.update(tokens=s.tokens, blocks=s.blocks, matched=s.matched, matched_tokens=s.matched_tokens,
                       reused=s.reused, hit_tokens=s.hit_tokens)
        d = decide(scores, {r["index"]: r["usage"] for r in rows})
        if d.pick is None:
            verdict = translate("engine.fleet.nobody", lang)
        elif len(d.tied) > 1:
            verdict = translate("engine.fleet.tie", lang, engines=", ".join(str(i) for i in d.tied),
                                tokens=d.best_tokens, pick=d.pick)
        else:
            verdict = translate("engine.fleet.pick", lang, engine=d.pick, url=self.links[d.pick].url,
                                tokens=d.best_tokens)
        return {"rows": rows, "pick": d.pick, "tied": list(d.tied), "best_tokens": d.best_tokens, "verdict": verdict}
