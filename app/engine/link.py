"""One configured engine: its KV-event sockets and its HTTP API, named at start-up only (``Settings.engine*``).

    EngineLink(name, url, events, replay)
      thread   SUB ``events``  ->  decode_frames  ->  mirror.apply          (a gap: replay first, then apply)
               a socket monitor says whether the SUB is connected or retrying (nothing listening there)
      thread   every ``poll_s``: GET url/metrics -> EngineMetrics; GET url/health   (HTTP: its own thread, so a
               new blocks' tokens -> POST url/detokenize, a few per loop             slow engine API never holds
                                                                                     back the events)
      on (re)connect: catch up from sequence 0 through the replay socket (vLLM keeps ``buffer_steps`` batches);
      and after ``IDLE_CATCH_UP_S`` without a frame, from the next expected one (a PUB drops what it sends before
      the SUB's subscription reaches it, and a lost last batch has no later one to reveal the gap)

Replay (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._service_replay``): a DEALER sends
(b"", start seq as 8 bytes big-endian) to the engine's ROUTER, which answers (b"", topic, seq, payload) per
buffered batch with seq ≥ start, then (b"", b"", -1 as 8 bytes signed, b"").

Nothing here takes an address from a request: the URLs are the link's own, fixed when the server started.
The mirror and the status are read under ``lock``; ``changed`` is notified after each change, and every stream that
``watch``es is woken in its own event loop.

Whatever the engine sends, the link goes on:
  * a batch that cannot be read (``BadEvents``: which field, which batch) or applied is counted, named on the page
    (``last_event_error``) and skipped; later batches are applied as usual;
  * an HTTP answer that is not what vLLM answers is an ``EngineBadAnswer`` (an ``EngineDown``): shown, never fatal;
    every number taken from it is finite, every string valid UTF-8;
  * an engine restart is only concluded from evidence, never from one failed poll: its sequence numbers begin
    again (events), or its own counters go backwards or its ``process_start_time_seconds`` changes (/metrics);
  * each thread runs under ``_supervised``: an exception that escapes anyway is logged, counted on the page
    (``thread_failures``) and the thread's loop starts again after a short back-off.
Bounded: one message at most ``max_message_bytes`` (an HTTP answer is not read further, a longer KV-event payload is
a bad batch, never decoded; zmq's own MAXMSGSIZE is not used: after it cuts a multipart message libzmq 4.3.5 stops
reconnecting, or aborts the process in ``fq.cpp``), the texts waiting for ``/detokenize`` at most
``max_pending_texts`` (newest first; those of blocks no longer held are dropped, the others counted in
``texts_dropped``), at most ``max_streams`` streams watching, the metrics log ``metrics_kept`` scrapes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from http.client import HTTPException
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from app.engine.events import (
    END_SEQ,
    MAX_BLOCK_SIZE,
    MAX_TOKEN_ID,
    AllBlocksCleared,
    BadEvents,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_frames,
    shown,
)
from app.engine.metrics import EngineMetrics
from app.engine.mirror import BlockMirror, Key
from app.errors import Busy
from app.i18n import Term

log = logging.getLogger("kvscope.engine")
IDLE_CATCH_UP_S = 2.0  # a connected link with no frame for this long asks the replay socket for anything newer


THREAD_BACKOFF_S = (0.1, 5.0)  # a failed thread's loop starts again after 0.1 s, doubling up to 5 s
BAD_BATCHES_LOGGED = 10  # the first bad batches are logged one by one, then one in LOG_EVERY
LOG_EVERY = 1000
BAD_SEQS_KEPT = 64
TEXT_CHARS_PER_TOKEN = 64  # a block's decoded text is cut there: no tokenizer's token is longer


class EngineDown(Busy):
    """An HTTP call to the engine failed (a catalog key naming the URL and why); a 503 when it reaches a page."""

    def __init__(self, key: str, /, **params: object) -> None:
        super().__init__(key, retry_after=5, **params)


class EngineBadAnswer(EngineDown):
    """The engine answered, but not what vLLM answers there (another shape, a type, a range): a 502."""

    status = 502


@dataclass(frozen=True)
class LinkLimits:
    poll_s: float = 1.0
    http_timeout_s: float = 5.0
    replay_timeout_s: float = 3.0
    max_blocks: int = 50_000
    max_changes: int = 4_000
    max_tokens: int = 2_000_000
    max_block_size: int = MAX_BLOCK_SIZE
    max_message_bytes: int = 32 * 2**20
    max_pending_texts: int = 2_000
    max_streams: int = 256
    stream_max_s: float = 300.0
    metrics_kept: int = 600
    texts_per_loop: int = 64


def http(url: str, *, body: dict | None = None, timeout: float = 5.0, max_bytes: int = 32 * 2**20) -> bytes:
    """GET (or POST ``body`` as JSON) ``url``, an answer of at most ``max_bytes``; ``EngineDown`` naming the
    failure."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (a configured engine's URL only)
            out = resp.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode("utf-8", "replace")
        raise EngineDown("err.engine.http_status", url=url, status=exc.code, detail=detail) from None
    except (urllib.error.URLError, OSError, TimeoutError, ValueError, HTTPException) as exc:
        # HTTPException: a status line or a body that is not HTTP (BadStatusLine, IncompleteRead …)
        reason = getattr(exc, "reason", exc)
        raise EngineDown("err.engine.unreachable", url=url, why=shown(reason, 200)) from None
    if len(out) > max_bytes:
        raise EngineBadAnswer("err.engine.too_big", url=url, most=max_bytes)
    return out


def _answer(url: str, raw: bytes) -> Any:
    """An HTTP answer's JSON (``EngineBadAnswer`` when it is not JSON)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise EngineBadAnswer("err.engine.not_json", url=url, why=type(exc).__name__) from None


def _bad(url: str, what: str) -> EngineBadAnswer:
    """``what``: the catalog key (``err.engine.answer.*``) saying what the answer lacks."""
    return EngineBadAnswer("err.engine.bad_answer", url=url, why=Term(what))


class EngineLink:
    def __init__(self, *, name: str, url: str, events: str | None, replay: str | None,
                 limits: LinkLimits = LinkLimits()) -> None:
        self.name, self.url, self.events, self.replay_endpoint = name, url.rstrip("/"), events, replay
        self.limits = limits
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.metrics: EngineMetrics | None = None
        self.metrics_log: deque[tuple[float, EngineMetrics]] = deque(maxlen=limits.metrics_kept)
        self.mirror = BlockMirror(max_blocks=limits.max_blocks, max_changes=limits.max_changes,
                                  max_tokens=limits.max_tokens)
        self.http_status: tuple[str, dict] | None = ("engine.status.starting", {})  # None: healthy
        self.events_connected = False
        self.event_errors = 0  # messages or batches skipped
        # The last one skipped: (catalog key, its parameters, its batch's sequence number, the event's index).
        self.last_event_error: tuple[str, dict, int | None, int | None] | None = None
        self._bad_seqs: OrderedDict[int, None] = OrderedDict()  # the last bad batches' numbers, counted once
        self.thread_failures: dict[str, int] = {}  # "events" | "http" -> times its loop failed and started again
        self.last_thread_failure: tuple[str, str] | None = None  # (which thread, the exception's type)
        self.model: str | None = None
        # Blocks whose text /detokenize has not given yet, newest last (taken newest first: the page draws those).
        self._texts: OrderedDict[Key, None] = OrderedDict()
        self.texts_dropped = 0  # held blocks whose text was never asked for: the queue was full
        self.texts_failed = 0  # blocks whose /detokenize answer was an error or unreadable
        self._stop = threading.Event()
        self._threads: dict[str, threading.Thread] = {}
        self._catch_up = threading.Event()  # the HTTP thread saw the engine restart: the events thread replays
        self._watchers: dict[tuple[asyncio.AbstractEventLoop, asyncio.Event], float] = {}  # -> when it expires

    # --- who is told of a change ----------------------------------------------------------------------------
    def _notify(self) -> None:
        """Wake the threads waiting on ``changed`` and every watching stream (their event loops, thread-safely).
        Called with ``lock`` held, as ``notify_all`` must be."""
        self.changed.notify_all()
        for loop, event in tuple(self._watchers):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: its stream is gone
                self._watchers.pop((loop, event), None)

    def watch(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
        """Set ``event`` (in ``loop``) after each change; the function that stops it. A live page's stream waits on
        it instead of looking at the clock, so a change reaches the page as soon as the line budget allows.

        At most ``max_streams`` at once (``Busy`` beyond). A watcher whose stream never ran its ``finally`` (its
        generator was never started) expires a little after the longest stream could have lasted."""
        now = time.monotonic()
        with self.lock:
            for key, expires in tuple(self._watchers.items()):
                if expires < now:
                    del self._watchers[key]
            if len(self._watchers) >= self.limits.max_streams:
                raise Busy("err.engine.streams", n=self.limits.max_streams, retry_after=10)
            self._watchers[loop, event] = now + self.limits.stream_max_s + 60

        def unwatch() -> None:
            with self.lock:
                self._watchers.pop((loop, event), None)

        return unwatch

    @property
    def texts_pending(self) -> int:
        """Blocks waiting for their text (read under ``lock``, as the snapshot does)."""
        return len(self._texts)

    @property
    def streams(self) -> int:
        """Streams watching this link now (one per open page following it: a page that leaves unwatches)."""
        with self.lock:
            return len(self._watchers)

    # --- the HTTP API (the link's own URL only) --------------------------------------------------------------
    # Each answer is checked where it enters: what these return has the types they say, whatever the engine sent.
    def get(self, path: str) -> bytes:
        return http(self.url + path, timeout=self.limits.http_timeout_s, max_bytes=self.limits.max_message_bytes)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST ``body``; the answer, a JSON object (``EngineBadAnswer`` for anything else)."""
        url = self.url + path
        out = _answer(url, http(url, body=body, timeout=timeout or self.limits.http_timeout_s,
                                max_bytes=self.limits.max_message_bytes))
        if not isinstance(out, dict):
            raise _bad(url, "err.engine.answer.not_object")
        return out

    def model_card(self) -> dict:
        """The first model ``/v1/models`` lists: its ``id``, ``root`` (the path it loaded, or None) and
        ``max_model_len`` (None unless a whole number ≥ 1)."""
        url = self.url + "/v1/models"
        data = _answer(url, self.get("/v1/models"))
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list) or not models or not isinstance(models[0], dict) \
                or not isinstance(models[0].get("id"), str) or not models[0]["id"]:
            raise _bad(url, "err.engine.answer.no_model")
        card = models[0]
        root, context = card.get("root"), card.get("max_model_len")
        return {"id": shown(card["id"], 200), "root": shown(root, 400) if isinstance(root, str) else None,
                "max_model_len": context if isinstance(context, int) and not isinstance(context, bool)
                and 1 <= context <= 2**31 else None}

    def served_model(self) -> str:
        if self.model is None:
            self.model = self.model_card()["id"]
        return self.model

    def scrape(self) -> EngineMetrics:
        return EngineMetrics.of(self.get("/metrics").decode("utf-8", "replace"))

    def tokenize(self, prompt: str) -> list[int]:
        out = self.post("/tokenize", {"model": self.served_model(), "prompt": prompt})
        tokens = out.get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in tokens):
            raise _bad(self.url + "/tokenize", "err.engine.answer.no_tokens")
        return tokens

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens`` (at most ``TEXT_CHARS_PER_TOKEN`` characters a token, valid UTF-8)."""
        out = self.post("/detokenize", {"model": self.served_model(), "tokens": tokens})
        if not isinstance(out.get("prompt"), str):
            raise _bad(self.url + "/detokenize", "err.engine.answer.no_text")
        return shown(out["prompt"], TEXT_CHARS_PER_TOKEN * max(1, len(tokens)))

    def complete(self, prompt: str, *, max_tokens: int = 1, timeout: float = 60.0,
                 extra: dict | None = None) -> str:
        """One completion of ``prompt``, greedy; the text generated. ``extra``: more fields of the request (the
        capture plugin's ``vllm_xargs``), never the model, prompt or sampling."""
        body = {**(extra or {}), "model": self.served_model(), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0}
        out = self.post("/v1/completions", body, timeout=timeout)
        choices = out.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise _bad(self.url + "/v1/completions", "err.engine.answer.no_choices")
        text = choices[0].get("text", "")
        return shown(text, 4000) if isinstance(text, str) else ""

    # --- the threads ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the events and HTTP threads, and any of them that is no longer alive."""
        self._stop.clear()
        for side, body in (("events", self._run), ("http", self._run_http)):
            thread = self._threads.get(side)
            if thread is None or not thread.is_alive():
                name = f"kvscope-engine-{self.name}" + ("-http" if side == "http" else "")
                thread = threading.Thread(target=self._supervised, args=(side, body), name=name, daemon=True)
                self._threads[side] = thread
                thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads.values():
            thread.join(timeout=5)
        self._threads.clear()

    def alive(self) -> dict[str, bool]:
        return {side: t.is_alive() for side, t in self._threads.items()}

    def _supervised(self, side: str, body: Callable[[], None]) -> None:
        """Run ``body`` until the link stops; an exception that escapes it is logged, counted on the page and the
        loop starts again (a short back-off first, doubling while it keeps failing)."""
        failures = 0
        while not self._stop.is_set():
            try:
                body()
                failures = 0
            except Exception as exc:  # the link must never end of what an engine does; it says so on the page
                failures += 1
                log.exception("engine link %s (%s) failed; starting it again", self.name, side)
                with self.changed:
                    self.thread_failures[side] = self.thread_failures.get(side, 0) + 1
                    self.last_thread_failure = (side, shown(type(exc).__name__))
                    self._notify()
                low, high = THREAD_BACKOFF_S
                self._stop.wait(min(high, low * 2 ** min(failures - 1, 10)))

    def _run(self) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        sub = monitor = None
        with self.changed:
            self.events_connected = False  # a new socket: connected when its monitor says so
            self._notify()
        if self.events:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.RECONNECT_IVL, 200)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                             | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED)
        poller = zmq.Poller()
        if sub is not None:
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
        quiet_since = time.monotonic()  # the last frame heard, or the last catch-up
        try:
            if sub is not None:
                sub.connect(self.events)
            while not self._stop.is_set():
                if self.events_connected and self.replay_endpoint and time.monotonic() - quiet_since >= IDLE_CATCH_UP_S:
                    self.catch_up()  # what a SUB can lose unnoticed: a batch published before its subscription
                    quiet_since = time.monotonic()  # took effect, or the last of a burst (no later seq shows the gap)
                if self._catch_up.is_set():
                    self._catch_up.clear()
                    with self.changed:
                        self._restart("http")
                        self._notify()
                    self.catch_up()
                ready = dict(poller.poll(timeout=100)) if sub is not None else {}
                if not ready and sub is None:
                    self._stop.wait(0.1)
                if monitor is not None and monitor in ready:
                    self._on_monitor(recv_monitor_message(monitor))
                if sub is not None and sub in ready:
                    for _ in range(1000):  # drain what is there, then look at the flags again
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames, live=True)
                        quiet_since = time.monotonic()
                        if self._catch_up.is_set():
                            break
        finally:
            if sub is not None and monitor is not None:  # made together, before the try
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
            with self.changed:
                self.events_connected = False
                self._notify()

    def _run_http(self) -> None:
        """Every ``poll_s``: /metrics and /health, then a few new blocks' texts. A thread of its own, so a slow
        engine API (a busy CPU, a long /detokenize) never holds back the events: those are the page's live part."""
        while not self._stop.is_set():
            t0 = time.monotonic()
            self._poll_http()
            self._fill_texts()
            self._stop.wait(max(0.0, self.limits.poll_s - (time.monotonic() - t0)))

    def _on_monitor(self, msg: dict) -> None:
        connected = msg["event"] == zmq.EVENT_CONNECTED
        with self.changed:
            was, self.events_connected = self.events_connected, connected
            self._notify()
        if connected and not was:
            self.catch_up()

    def _on_frames(self, frames: list[bytes], *, live: bool) -> None:
        batch = self._decode(frames)
        if batch is not None:
            self._on_batch(batch, live=live)

    def _decode(self, frames: list[bytes]) -> EventBatch | None:
        """The frames' batch, or None after counting them as bad (the message that names why is kept)."""
        try:
            return decode_frames(frames, max_block_size=self.limits.max_block_size,
                                 max_bytes=self.limits.max_message_bytes)
        except BadEvents as exc:
            self._skipped(exc.key, exc.params, exc.seq, exc.event)
            return None

    def _skipped(self, key: str, params: dict, seq: int | None, event: int | None) -> None:
        """Count one unreadable message, once per sequence number (heard live, then replayed for the gap it left, is
        one). Its number does not move the mirror on: garbage can carry any number, even the one the engine's next
        batch will carry; a batch of the engine's own that is unreadable is missing, and a gap when replay cannot
        give it either."""
        with self.changed:
            if seq is not None:
                if seq in self._bad_seqs:
                    return
                self._bad_seqs[seq] = None
                if len(self._bad_seqs) > BAD_SEQS_KEPT:
                    self._bad_seqs.popitem(last=False)
            self.event_errors += 1
            self.last_event_error = (key, params, seq, event)
            n = self.event_errors
            self._notify()
        if n <= BAD_BATCHES_LOGGED or n % LOG_EVERY == 0:
            log.warning("engine link %s: skipped an event message (%d so far), batch %s event %s: %s", self.name, n,
                        seq, event, BadEvents(key, **params).message)

    def _apply(self, batch: EventBatch, *, replayed: bool) -> bool:
        """Apply one batch (``lock`` held); a batch the mirror cannot apply is counted and skipped like a bad one.
        Its texts are queued for /detokenize."""
        try:
            applied = self.mirror.apply(batch, replayed=replayed)
        except Exception as exc:  # decode_frames checked every field: this is a bug of ours, never the link's end
            log.exception("engine link %s: batch %d could not be applied", self.name, batch.seq)
            self.event_errors += 1
            self.last_event_error = ("err.engine.batch_failed", {"why": shown(type(exc).__name__)}, batch.seq, None)
            return False
        if applied:
            self._queue_texts(batch)
        return applied

    def _queue_texts(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                for h, _, _ in ev.blocks():
                    key = (ev.group_idx or 0, ev.medium or "GPU", h)
                    self._texts.pop(key, None)
                    self._texts[key] = None
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._texts.pop((ev.group_idx or 0, ev.medium or "GPU", h), None)
            elif isinstance(ev, AllBlocksCleared):
                self._texts.clear()
        while len(self._texts) > self.limits.max_pending_texts:
            key, _ = self._texts.popitem(last=False)
            block = self.mirror.blocks.get(key)
            self.texts_dropped += block is not None and block.text is None

    def _restart(self, reason: str) -> None:
        """The engine started again (``lock`` held): an empty mirror, nothing left to decode."""
        self.mirror.restart(reason)
        self._texts.clear()

    def _on_batch(self, batch: EventBatch, *, live: bool, replayed: bool = False) -> None:
        with self.changed:
            restart = live and self.mirror.is_restart(batch)
            if restart:
                self._restart("seq")
            missing = self.mirror.missing_before(batch.seq)
            if restart and batch.seq > 0:  # a new engine: what it published before this one is in its replay buffer
                missing = (0, batch.seq - 1)
        if missing is not None and live:
            self.replay(missing[0], until=batch.seq)
            with self.changed:
                missing = self.mirror.missing_before(batch.seq)
                if missing is not None:
                    self.mirror.record_gap(*missing)
        with self.changed:
            self._apply(batch, replayed=replayed)
            self._notify()

    # --- replay ----------------------------------------------------------------------------------------------
    def catch_up(self) -> int:
        """Ask the replay socket for everything from the next expected batch (0 on a first connect)."""
        with self.lock:
            start = self.mirror.next_seq or 0
        return self.replay(start)

    def replay(self, start: int, until: int | None = None) -> int:
        """Apply the engine's buffered batches from ``start`` (before ``until``); the number applied."""
        if not self.replay_endpoint:
            return 0
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        applied = 0
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.limits.replay_timeout_s
            while time.monotonic() < deadline:
                if not sock.poll(timeout=max(1, int(1000 * (deadline - time.monotonic())))):
                    break
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3 and len(frames[1]) == 8 and int.from_bytes(frames[1], "big", signed=True) \
                        == END_SEQ:
                    break
                batch = self._decode(frames)
                if batch is None:
                    continue
                if until is not None and batch.seq >= until:
                    continue
                with self.changed:
                    applied += self._apply(batch, replayed=True)
                    self._notify()
        finally:
            sock.close(linger=0)
        return applied

    # --- HTTP polling ----------------------------------------------------------------------------------------
    def _poll_http(self) -> None:
        """One scrape. A failed one is shown and changes nothing else: an engine that answers 500 once, or is too
        busy to answer in time, has not restarted. A restart is concluded from the engine's own figures only
        (``EngineMetrics.restarted_since``); then the events thread empties the mirror and replays from 0."""
        try:
            metrics = self.scrape()
        except EngineDown as exc:
            with self.changed:
                self.http_status = (exc.key, exc.params)
                self._notify()
            return
        with self.changed:
            restarted = self.metrics is not None and metrics.restarted_since(self.metrics)
            self.metrics = metrics
            self.metrics_log.append((time.time(), metrics))
            self.http_status = None
            self._notify()
        if restarted:  # a new process: an empty cache, sequence numbers from 0
            self._catch_up.set()  # the events thread empties the mirror and replays, between two of its batches

    def _fill_texts(self) -> None:
        """Decode up to ``texts_per_loop`` blocks' tokens with the engine's own tokenizer (``/detokenize``), newest
        first. An engine that does not answer keeps the block queued; one that answers an error or something
        unreadable for it loses it (counted in ``texts_failed``): asking again would block the others."""
        asked = 0
        while asked < self.limits.texts_per_loop and not self._stop.is_set():
            with self.lock:
                if not self._texts:
                    return
                key, _ = self._texts.popitem(last=True)
                block = self.mirror.blocks.get(key)
                if block is None or block.text is not None:
                    continue  # no longer held (or decoded already): no call
                tokens = list(block.token_ids)
            asked += 1
            try:
                text = self.detokenize(tokens)
            except EngineDown as exc:
                with self.lock:
                    if exc.key == "err.engine.unreachable":
                        self._texts.setdefault(key, None)
                    else:
                        self.texts_failed += 1
                return
            with self.changed:
                block.text = text
                self._notify()

    # --- reading ---------------------------------------------------------------------------------------------
    def wait(self, version: int, timeout: float) -> int:
        """Block until the mirror's version passes ``version`` (or ``timeout``); the version now."""
        with self.changed:
            self.changed.wait_for(lambda: self.mirror.version > version, timeout=timeout)
            return self.mirror.version
