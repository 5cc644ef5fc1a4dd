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
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from app.engine.events import END_SEQ, BadEvents, EventBatch, decode_frames
from app.engine.metrics import EngineMetrics
from app.engine.mirror import BlockMirror
from app.errors import Busy

log = logging.getLogger("kvscope.engine")
IDLE_CATCH_UP_S = 2.0  # a connected link with no frame for this long asks the replay socket for anything newer


class EngineDown(Busy):
    """An HTTP call to the engine failed (a catalog key naming the URL and why); a 503 when it reaches a page."""

    def __init__(self, key: str, /, **params: object) -> None:
        super().__init__(key, retry_after=5, **params)


@dataclass(frozen=True)
class LinkLimits:
    poll_s: float = 1.0
    http_timeout_s: float = 5.0
    replay_timeout_s: float = 3.0
    max_blocks: int = 50_000
    max_changes: int = 4_000
    metrics_kept: int = 600
    texts_per_loop: int = 64


def http(url: str, *, body: dict | None = None, timeout: float = 5.0) -> bytes:
    """GET (or POST ``body`` as JSON) ``url``; ``EngineDown`` naming the failure."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (a configured engine's URL only)
            return resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode("utf-8", "replace")
        raise EngineDown("err.engine.http_status", url=url, status=exc.code, detail=detail) from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise EngineDown("err.engine.unreachable", url=url, why=str(reason)[:200]) from None


class EngineLink:
    def __init__(self, *, name: str, url: str, events: str | None, replay: str | None,
                 limits: LinkLimits = LinkLimits()) -> None:
        self.name, self.url, self.events, self.replay_endpoint = name, url.rstrip("/"), events, replay
        self.limits = limits
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.mirror = BlockMirror(max_blocks=limits.max_blocks, max_changes=limits.max_changes)
        self.metrics: EngineMetrics | None = None
        self.metrics_log: deque[tuple[float, EngineMetrics]] = deque(maxlen=limits.metrics_kept)
        self.http_status: tuple[str, dict] | None = ("engine.status.starting", {})  # None: healthy
        self.events_connected = False
        self.event_errors = 0
        self.last_event_error: tuple[str, dict] | None = None
        self.model: str | None = None
        self._texts: deque[tuple[int, str, int]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http_thread: threading.Thread | None = None
        self._catch_up = threading.Event()  # the HTTP thread saw the engine come back: the events thread replays
        self._was_down = False
        self._watchers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    # --- who is told of a change ----------------------------------------------------------------------------
    def _notify(self) -> None:
        """Wake the threads waiting on ``changed`` and every watching stream (their event loops, thread-safely).
        Called with ``lock`` held, as ``notify_all`` must be."""
        self.changed.notify_all()
        for loop, event in tuple(self._watchers):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: its stream is gone
                self._watchers.discard((loop, event))

    def watch(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
        """Set ``event`` (in ``loop``) after each change; the function that stops it. A live page's stream waits on
        it instead of looking at the clock, so a change reaches the page as soon as the line budget allows."""
        with self.lock:
            self._watchers.add((loop, event))

        def unwatch() -> None:
            with self.lock:
                self._watchers.discard((loop, event))

        return unwatch

    @property
    def streams(self) -> int:
        """Streams watching this link now (one per open page following it: a page that leaves unwatches)."""
        with self.lock:
            return len(self._watchers)

    # --- the HTTP API (the link's own URL only) --------------------------------------------------------------
    def get(self, path: str) -> bytes:
        return http(self.url + path, timeout=self.limits.http_timeout_s)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        return json.loads(http(self.url + path, body=body, timeout=timeout or self.limits.http_timeout_s))

    def served_model(self) -> str:
        if self.model is None:
            data = json.loads(self.get("/v1/models"))
            self.model = data["data"][0]["id"]
        return self.model

    def scrape(self) -> EngineMetrics:
        return EngineMetrics.of(self.get("/metrics").decode("utf-8", "replace"))

    def tokenize(self, prompt: str) -> list[int]:
        return self.post("/tokenize", {"model": self.served_model(), "prompt": prompt})["tokens"]

    def complete(self, prompt: str, *, max_tokens: int = 1, timeout: float = 60.0) -> dict:
        return self.post("/v1/completions", {"model": self.served_model(), "prompt": prompt,
                                             "max_tokens": max_tokens, "temperature": 0}, timeout=timeout)

    # --- the thread ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"kvscope-engine-{self.name}", daemon=True)
            self._http_thread = threading.Thread(target=self._run_http, name=f"kvscope-engine-{self.name}-http",
                                                 daemon=True)
            self._thread.start()
            self._http_thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._http_thread):
            if thread is not None:
                thread.join(timeout=5)
        self._thread = self._http_thread = None

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sub = monitor = None
        if self.events:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.RECONNECT_IVL, 200)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                             | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED)
            sub.connect(self.events)
        poller = zmq.Poller()
        if sub is not None:
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
        quiet_since = time.monotonic()  # the last frame heard, or the last catch-up
        try:
            while not self._stop.is_set():
                if self.events_connected and self.replay_endpoint and time.monotonic() - quiet_since >= IDLE_CATCH_UP_S:
                    self.catch_up()  # what a SUB can lose unnoticed: a batch published before its subscription
                    quiet_since = time.monotonic()  # took effect, or the last of a burst (no later seq shows the gap)
                if self._catch_up.is_set():
                    self._catch_up.clear()
                    with self.changed:
                        self.mirror.restart("http")
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
        except Exception:  # the link must never take the server down; it says so on the page
            log.exception("engine link %s stopped", self.name)
            with self.changed:
                self.http_status = ("engine.status.link_failed", {})
                self._notify()
        finally:
            if sub is not None:
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)

    def _run_http(self) -> None:
        """Every ``poll_s``: /metrics and /health, then a few new blocks' texts. A thread of its own, so a slow
        engine API (a busy CPU, a long /detokenize) never holds back the events: those are the page's live part."""
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                self._poll_http()
                self._fill_texts()
                self._stop.wait(max(0.0, self.limits.poll_s - (time.monotonic() - t0)))
        except Exception:  # as the events thread: never the server's end
            log.exception("engine link %s (HTTP) stopped", self.name)
            with self.changed:
                self.http_status = ("engine.status.link_failed", {})
                self._notify()

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

    def _decode(self, frames: list[bytes]):
        """The frames' batch, or None after counting them as bad (the message that names why is kept)."""
        try:
            return decode_frames(frames)
        except BadEvents as exc:
            with self.changed:
                self.event_errors += 1
                self.last_event_error = (exc.key, exc.params)
                self._notify()
            return None

    def _on_batch(self, batch: EventBatch, *, live: bool, replayed: bool = False) -> None:
        with self.changed:
            restart = live and self.mirror.is_restart(batch)
            if restart:
                self.mirror.restart("seq")
            missing = self.mirror.missing_before(batch.seq)
        if missing is not None and live:
            self.replay(missing[0], until=batch.seq)
            with self.changed:
                missing = self.mirror.missing_before(batch.seq)
                if missing is not None:
                    self.mirror.record_gap(*missing)
        with self.changed:
            if self.mirror.apply(batch, replayed=replayed):
                for ev in batch.events:
                    for h, _, _ in getattr(ev, "blocks", lambda: [])():
                        self._texts.append((ev.group_idx or 0, ev.medium or "GPU", h))
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
        sock = zmq.Context.instance().socket(zmq.DEALER)
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
                    if self.mirror.apply(batch, replayed=True):
                        applied += 1
                        for ev in batch.events:
                            for h, _, _ in getattr(ev, "blocks", lambda: [])():
                                self._texts.append((ev.group_idx or 0, ev.medium or "GPU", h))
                    self._notify()
        finally:
            sock.close(linger=0)
        return applied

    # --- HTTP polling ----------------------------------------------------------------------------------------
    def _poll_http(self) -> None:
        try:
            metrics = self.scrape()
        except EngineDown as exc:
            with self.changed:
                self.http_status = (exc.key, exc.params)
                self._was_down = True
                self._notify()
            return
        with self.changed:
            back = self._was_down and self.metrics is not None
            self.metrics = metrics
            self.metrics_log.append((time.time(), metrics))
            self.http_status = None
            self._was_down = False
            self._notify()
        if back:  # it went away and answers again: a new process, an empty cache, sequence numbers from 0
            self._catch_up.set()  # the events thread empties the mirror and replays, between two of its batches

    def _fill_texts(self) -> None:
        """Decode a few new blocks' tokens with the engine's own tokenizer (``/detokenize``)."""
        for _ in range(self.limits.texts_per_loop):
            with self.lock:
                if not self._texts:
                    return
                key = self._texts.popleft()
                block = self.mirror.blocks.get(key)
            if block is None or block.text is not None:
                continue
            try:
                text = self.post("/detokenize", {"model": self.served_model(), "tokens": list(block.token_ids)})
            except (EngineDown, KeyError, ValueError):
                return
            with self.changed:
                block.text = text.get("prompt", "")
                self._notify()

    # --- reading ---------------------------------------------------------------------------------------------
    def wait(self, version: int, timeout: float) -> int:
        """Block until the mirror's version passes ``version`` (or ``timeout``); the version now."""
        with self.changed:
            self.changed.wait_for(lambda: self.mirror.version > version, timeout=timeout)
            return self.mirror.version
