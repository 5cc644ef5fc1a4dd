"""The Engine lab (/engine): a real serving engine's KV cache, live, beside KVScope's own engine.

The lab orchestrates: it owns the links, copies what a view reads under a link's lock, runs one drive at a time per
engine (``app/engine/drive.py``) and keeps each browser's last comparison; the views themselves, worded, are pure
functions of ``app/viz/engine.py``.

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
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from app import catalog
from app.cache.prefix import PRESETS, scaled_presets
from app.engine.drive import run_drive
from app.engine.fleet import EngineIndex, IndexBlock, fleet_chains, score
from app.engine.hashing import VllmBlockHasher, external
from app.engine.link import EngineDown, EngineLink, LinkLimits
from app.errors import BadInput, Busy, NotFound
from app.i18n import translate
from app.labs.limits import Limits
from app.viz import engine as views
from app.viz.engine import json_line

PRESET_SCALE = 5  # the prefix presets' shared parts said 5 times: 80-210 SmolLM2 tokens, 2-6 blocks of 32
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
    engine_served_max_traces: int
    engine_served_per_browser: int
    engine_served_max_mib: int
    engine_served_timeout_s: float
    engine_served_max_new_tokens: int


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

    def blocks_held(self, index: int, hashes: list[int]) -> list[tuple[int, tuple[int, ...]] | None]:
        """For each event id in ``hashes``: (the event batch that stored it, its token ids) as engine ``index``'s
        mirror holds it (group 0, any medium), or None where the mirror does not hold it."""
        link = self.link(index)
        with link.lock:
            by_hash = {b.block_hash: b for b in link.mirror.blocks.values() if b.group_idx == 0}
            return [(b.seq, b.token_ids) if (b := by_hash.get(h)) is not None else None for h in hashes]

    def last_run(self, owner: str) -> dict | None:
        """This browser's last comparison (a drive's view), while it is among the newest ``engine_max_runs_kept``."""
        with self._runs_lock:
            return self.runs.get(owner)

    # --- views ------------------------------------------------------------------------------------------------
    def page(self, lang: str) -> dict:
        return {"configured": bool(self.links), "presets": list(PRESETS),
                "engines": [{"index": i, "url": ln.url, "events": ln.events, "replay": ln.replay_endpoint}
                            for i, ln in enumerate(self.links)],
                "max_shown": self.limits.engine_max_shown_blocks}

    def status(self, link: EngineLink, lang: str) -> list[dict]:
        """What is wrong or worth saying, most important first (each a sentence in ``lang``); ``ok`` when nothing."""
        return views.status_lines(link, lang, most_pending_texts=link.limits.max_pending_texts)

    def metrics_view(self, link: EngineLink) -> dict | None:
        with link.lock:  # the HTTP thread appends to the log: it is read as a copy, taken under the lock
            m, log, down = link.metrics, tuple(link.metrics_log), link.http_status
        stopped = down is not None and down[0].startswith("err.")
        return views.metrics_view(m, log, time.time(), stopped=stopped)

    def calculator_line(self, link: EngineLink) -> dict | None:
        """KVScope's calculator on the engine's own configuration, beside the engine's ``cache_config_info``
        (``app/viz/engine.py``'s ``calculator_line``)."""
        m = link.metrics
        if m is None:
            return None
        try:
            card = link.model_card()
        except EngineDown:
            card = None
        return views.calculator_line(m, views.catalog_model(card), card["max_model_len"] if card else None,
                                     max_block_size=self.limits.engine_max_block_size,
                                     batched_tokens=self.limits.engine_max_num_batched_tokens)

    def engine_model(self, link: EngineLink) -> catalog.ModelConfig | None:
        """The catalog's entry for the engine's model (matched on its served name or the path it loaded)."""
        try:
            return views.catalog_model(link.model_card())
        except EngineDown:
            return None

    def snapshot(self, index: int, lang: str) -> dict:
        link = self.link(index)
        streams = link.streams  # pages following it now (taken before the lock: it takes the lock itself)
        with link.lock:
            view = views.snapshot_view(index, link, lang, streams=streams,
                                       max_shown=self.limits.engine_max_shown_blocks,
                                       most_pending_texts=link.limits.max_pending_texts)
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
            prompts = scaled_presets(PRESET_SCALE)[preset][: self.limits.engine_drive_max_requests]
            run = run_drive(link, prompts, max_block_size=self.limits.engine_max_block_size,
                            max_blocks=self.limits.engine_drive_max_blocks,
                            timeout_s=self.limits.engine_drive_timeout_s)
        finally:
            lock.release()
        result = views.drive_view(preset, link.url, run, lang)
        with self._runs_lock:
            self.runs[owner] = result
            self.runs.move_to_end(owner)
            while len(self.runs) > self.limits.engine_max_runs_kept:
                self.runs.popitem(last=False)
        return result

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
        return views.fleet_view(indexes, self.links, chains, total)

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
            row = views.route_row(i, link.url, ix, ok)
            rows.append(row)
            if (why := views.unroutable(ix, lang)) is not None or not ix.block_size:  # (it names a missing size)
                row["error"] = why
                continue
            try:
                ids = link.tokenize(prompt)
            except EngineDown as exc:
                row["error"] = translate(exc.key, lang, **exc.params)
                continue
            s = score(ix, ids, VllmBlockHasher().request(ids, ix.block_size))
            scores.append(s)
            views.scored_row(row, s)
        return views.route_view(rows, scores, [ln.url for ln in self.links], lang)
