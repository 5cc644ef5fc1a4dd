"""What the server holds, who it belongs to, and how long it lives. Everything is created in ``AppState.create``.

=================  ==========================  ==============================  ==================================
field              what                        belongs to                      lives until
=================  ==========================  ==============================  ==================================
registry           the loaded models           the server                      shutdown (a trained model is added
                                                                               under a new name, never swapped in)
model_lock         ``ModelGate``: one forward  the server                      shutdown
                   at a time, short work first,
                   a bounded queue
traces             captured traces, slimmed    shared (content-addressed: the  idle ``trace_ttl_s``, LRU within
                   to what the pages show      same model + tokens, same key)  ``trace_cache_bytes``
trace_index        trace key -> model, tokens  shared                          10 000 newest keys (recomputable)
sessions           decode sessions             the browser that made them      idle ``session_ttl_s``, or the
                                                                               browser's 4th; ``session_cache_bytes``
paged_pools        paged-lab block pools       the browser that made them      idle ``session_ttl_s``, or the
                                                                               browser's 3rd; ``paged_cache_bytes``
prefix_labs        prefix-cache lab            one per browser                 idle ``session_ttl_s``;
                                                                               ``prefix_cache_bytes`` in all
head_surveys       head-roles scores, one per  the server (shared: the same    as long as that model object is
                   model (``/heads``)          sequence for every browser)     served
arena_lab          the arena's line: waiting   each run the browsers that      a run: until it ends, or the last
                   runs, the running one, and  asked for it (identical         request following it goes;
                   finished results by request requests share one run)         results: ``arena_cache_runs``, LRU
training           the Training lab and its    a run: the browser that         the line as the arena's; the run
                   line (one run at a time,    started it; the running one is  pages show: until the next starts
                   the others wait in line)    shown to everyone
long_line          long captures' line (one    the browsers that asked for it  a run: until it ends or is stopped;
                   at a time, progress by      (the same tokens: one run)      its trace then lives in ``traces``
                   layer, Stop)
zoom               the zoom's pooled bases,    shared, by trace key            LRU within ``zoom_cache_bytes``
                   per head (app/labs/zoom.py)
=================  ==========================  ==============================  ==================================

A browser is its ``kvscope_owner`` cookie (``app/web/security.py``: an id the server minted and signed). Besides
each browser's own cap, the browsers at one network address share at most ``address_share`` of each server-wide
cap (sessions, pools, labs, the model queue, the labs' lines): ``per_address`` below. The janitor thread
(``start_janitor``) releases whatever expired every ``purge_interval_s`` and hands freed memory back to the OS.
cap (sessions, pools, labs, the model queue): ``per_address`` below. The janitor thread (``start_janitor``)
releases whatever expired every ``purge_interval_s`` and hands freed memory back to the OS (``app/memory.py``:
MKL's idle scratch pools and glibc's free pages).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.admission import ModelGate
from app.cache.paged_decode import PagedEngine
from app.cache.prefix import PrefixLab
from app.errors import BadInput, Expired
from app.labs.queue import LabQueue
from app.labs.zoom import ZoomLab
from app.memory import page_in, release_free_memory, tune_allocators
from app.model.capture import run_traced
from app.model.head_survey import SurveyCache
from app.model.loading import LoadedModel, ModelRegistry
from app.model.prompts import encode_prompt
from app.model.sessions import SessionStore
from app.model.store import LENS_POSITIONS, TraceStore, check_trace_fits, shape_only, slim, tail_only
from app.model.trace import Trace
from app.owned import OwnedTable
from app.settings import Settings
from app.viz.tokens import honest_texts

if TYPE_CHECKING:
    from app.training.jobs import TrainingLab

log = logging.getLogger("kvscope")


@dataclass
class AppState:
    settings: Settings
    registry: ModelRegistry
    traces: TraceStore
    sessions: SessionStore
    paged_pools: OwnedTable[PagedEngine]
    prefix_labs: OwnedTable[PrefixLab]
    model_lock: ModelGate
    head_surveys: SurveyCache
    arena_lab: LabQueue
    # trace key -> (model name, token ids, the model object it ran on): small, so it outlives the traces
    # themselves and lets an evicted trace be recomputed from a page's link.
    trace_index: OrderedDict[str, tuple[str, tuple[int, ...], weakref.ref]] = field(default_factory=OrderedDict)
    training: TrainingLab = field(init=False)
    long_line: LabQueue = field(init=False)
    zoom: ZoomLab = field(init=False)
    long_rates: dict[str, float] = field(default_factory=dict)  # model -> bytes per token of its last long trace
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _janitor: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def create(cls, settings: Settings, registry: ModelRegistry) -> AppState:
        from app.training.jobs import TrainingLab

        s = settings
        ttl = s.session_ttl_s

        def per_address(server_cap: int, per_browser: int) -> int:
            return max(per_browser, math.ceil(s.address_share * server_cap))

        state = cls(
            settings=s,
            registry=registry,
            traces=TraceStore(s.trace_cache_bytes, ttl_s=s.trace_ttl_s, keep_one_bytes=s.trace_keep_one_bytes),
            sessions=SessionStore(ttl_s=ttl, max_sessions=s.max_sessions, max_bytes=s.session_cache_bytes,
                                  max_steps=s.max_decode_steps, max_per_owner=s.max_sessions_per_browser,
                                  max_per_address=per_address(s.max_sessions, s.max_sessions_per_browser)),
            paged_pools=OwnedTable(kind="pools", per_owner=s.max_paged_pools_per_browser,
                                   max_items=s.max_paged_pools, ttl_s=ttl, max_bytes=s.paged_cache_bytes,
                                   per_address=per_address(s.max_paged_pools, s.max_paged_pools_per_browser)),
            prefix_labs=OwnedTable(kind="labs", per_owner=1, max_items=s.max_prefix_labs, ttl_s=ttl,
                                   max_bytes=s.prefix_cache_bytes, per_address=per_address(s.max_prefix_labs, 1)),
            model_lock=ModelGate(max_waiting=s.queue_max_waiting, per_owner=s.queue_per_browser,
                                 max_wait_s=s.queue_max_wait_s,
                                 per_address=per_address(s.queue_max_waiting, s.queue_per_browser)),
            head_surveys=SurveyCache(),
            arena_lab=None,  # type: ignore[arg-type]  (made below: it needs the gate)
        )
        state.arena_lab = state.lab_queue("arena", max_run_s=s.arena_max_s, cache_items=s.arena_cache_runs)
        state.training = TrainingLab(state)
        state.long_line = state.lab_queue("long", max_run_s=s.long_capture_max_s)
        state.zoom = ZoomLab(s.zoom_cache_bytes)
        return state

    def lab_queue(self, name: str, *, max_run_s: float, cache_items: int = 0) -> LabQueue:
        """A lab's line (``app/labs/queue.py``) with the server's limits, its runs taking the model gate."""
        s = self.settings
        return LabQueue(name=name, gate=self.model_lock, max_queued=s.lab_queue_max, per_owner=s.lab_jobs_per_browser,
                        per_address=max(s.lab_jobs_per_browser, math.ceil(s.address_share * s.lab_queue_max)),
                        max_wait_s=s.lab_max_wait_s, max_run_s=max_run_s, cache_items=cache_items)

    # --- models and traces ----------------------------------------------------------------------------
    def model(self, name: str | None) -> LoadedModel:
        if name and name not in self.registry.models:
            raise BadInput("err.model.unknown", name=repr(name), models=", ".join(self.registry.names))
        return self.registry.get(name)

    def _key(self, lm: LoadedModel, ids: list[int] | tuple[int, ...]) -> str:
        # id(lm) makes a model loaded again under the same name (other weights) give other keys.
        digest = hashlib.sha256(f"{lm.name}|{id(lm)}|{','.join(map(str, ids))}".encode()).hexdigest()[:20]
        self.trace_index[digest] = (lm.name, tuple(ids), weakref.ref(lm))
        self.trace_index.move_to_end(digest)
        while len(self.trace_index) > 10_000:
            self.trace_index.popitem(last=False)
        return digest

    def _compute(self, lm: LoadedModel, ids: list[int]) -> Trace:
        long = len(ids) > self.settings.full_trace_max_tokens
        with self.model_lock:
            # Token texts as the pages show them: a byte piece of a multi-byte character by its byte values. What
            # ``slim`` drops is not held while the forward runs: activations by shape only, no copy of K/V in a cache,
            # a long prompt's per-position activations cut to its last positions as they are hooked.
            return slim(run_traced(lm.model, lm.adapter, ids, honest_texts(lm, ids), keep_cache=False,
                                   all_logits=len(ids) <= self.settings.full_logits_max_tokens,
                                   shape_only=shape_only, tail_only=tail_only if long else None,
                                   tail=LENS_POSITIONS if long else 0))

    def trace_key(self, lm: LoadedModel, ids: list[int] | tuple[int, ...]) -> str:
        """The key a trace of these tokens is kept and found under (``trace_by_key``)."""
        return self._key(lm, ids)

    def compute_trace(self, lm: LoadedModel, ids: list[int]) -> Trace:
        """One capture, as the pages keep it (under the model gate)."""
        return self._compute(lm, ids)

    def trace_prompt(self, model: str | None, prompt: str | None, *, chat: bool = False
                     ) -> tuple[LoadedModel, str, Trace]:
        lm = self.model(model)
        ids = encode_prompt(lm, prompt, max_chars=self.settings.max_prompt_chars, chat=chat)
        check_trace_fits(lm.adapter, len(ids), self.settings)
        key = self._key(lm, ids)
        return lm, key, self.traces.get_or_compute(key, lambda: self._compute(lm, ids))

    def trace_by_key(self, key: str) -> tuple[LoadedModel, Trace]:
        if key not in self.trace_index:
            raise Expired("err.trace.expired")
        name, ids, ref = self.trace_index[key]
        lm = self.registry.models.get(name)
        if lm is None:  # a trained model dropped since (Settings.max_trained_models)
            raise Expired("err.classroom.model_gone", model=name)
        if ref() is not lm:  # the model this view was made with is no longer served
            raise Expired("sturdy.model_changed", model=name)
        return lm, self.traces.get_or_compute(key, lambda: self._compute(lm, list(ids)))

    # --- memory and expiry --------------------------------------------------------------------------------
    def prepare_memory(self) -> dict[str, int]:
        """Once, when a server starts and before its first request: glibc's allocator set as the settings say and
        every model's weights paged in (``app/memory.py``), so the RSS measured then is what serving holds."""
        applied = tune_allocators(self.settings)
        for lm in self.registry.models.values():
            page_in(lm.model)
        return applied

    def purge(self) -> int:
        """Release every expired session, pool and lab now; give freed memory back to the OS."""
        n = self.sessions.purge() + self.paged_pools.purge() + self.prefix_labs.purge() + self.traces.purge()
        release_free_memory()
        return n

    def start_janitor(self) -> None:
        if self._janitor is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(self.settings.purge_interval_s):
                try:
                    self.purge()
                except Exception:  # the janitor must outlive any one bad object
                    log.exception("purge failed")

        self._janitor = threading.Thread(target=loop, name="kvscope-janitor", daemon=True)
        self._janitor.start()

    def stop_labs(self) -> None:
        """Every lab's runs stop (server shutdown): waiting ones leave their line, running ones stop at their
        next piece."""
        self.arena_lab.close()
        self.training.line.close()
        self.long_line.close()

    def stop_janitor(self) -> None:
        self._stop.set()
        if self._janitor is not None:
            self._janitor.join(timeout=5)
        self._janitor = None
