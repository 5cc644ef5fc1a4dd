"""The composition root: what the server holds, who it belongs to, and how long it lives. Everything is created in
``AppState.create``, and each lab (``app/labs/``) is handed exactly the pieces it uses; the routes reach a lab
through ``app/web/deps.py``. This module may import from every layer below the web; nothing below the web imports
it (``tests/test_layers.py``).

=================  ==========================  ==============================  ==================================
field              what                        belongs to                      lives until
=================  ==========================  ==============================  ==================================
registry           the loaded models           the server                      shutdown (a trained model is added
                                                                               under a new name, never swapped in)
model_lock         ``ModelGate``: one forward  the server                      shutdown
                   at a time, short work first,
                   a bounded queue
traces             captured traces, slimmed    shared (content-addressed: the  idle ``trace_ttl_s``, LRU within
                   to what the pages show      same model + tokens, same key); ``trace_cache_bytes``; a long one
                                               kept for the browser that made  only for its browser's newer or
                                               it (``trace_browser_bytes``)    another's long one
inspect.index      trace key -> model, tokens  shared                          10 000 newest keys (recomputable)
sessions           decode sessions             the browser that made them      idle ``session_ttl_s``, or the
                                                                               browser's 4th; ``session_cache_bytes``
paged_pools        paged-lab block pools       the browser that made them      idle ``session_ttl_s``, or the
                                                                               browser's 3rd; ``paged_cache_bytes``
prefix_labs        prefix-cache lab            one per browser                 idle ``session_ttl_s``;
                                                                               ``prefix_cache_bytes`` in all
head_surveys       head-roles scores, one per  the server (shared: the same    as long as that model object is
                   model (``/heads``)          sequence for every browser)     served
arena              the arena's line: waiting   each run the browsers that      a run: until it ends, or the last
                   runs, the running one, and  asked for it (identical         request following it goes;
                   finished results by request requests share one run)         results: ``arena_cache_runs``, LRU
training           the Training lab and its    a run: the browser that         the line as the arena's; the run
                   line (one run at a time,    started it; the running one is  pages show: until the next starts
                   the others wait in line)    shown to everyone
long.line          long captures' line (one    the browsers that asked for it  a run: until it ends or is stopped;
                   at a time, progress by      (the same tokens: one run)      its trace then lives in ``traces``
                   layer, Stop)
zoom               the zoom's pooled bases,    shared, by trace key            LRU within ``zoom_cache_bytes``
                   per head (app/labs/zoom.py)
kit                pins on disk (home/kit):    the server: every browser may   until deleted (by the pinning
                   results as JSON, traces as  open a pin; only the pinning    browser or the loopback);
                   safetensors mapped into     browser or the loopback may     ``kit_disk_bytes`` on disk;
                   ``inspect.pinned``          delete it                       a pinned trace never expires
engine             one link per configured     the server (the engines are     shutdown (threads started with the
                   engine (its mirror, its     named at start-up only); each   janitor, stopped with the labs);
                   metrics) and the last       browser's last comparison       ``engine_max_blocks`` a mirror,
                   comparisons                                                 ``engine_max_runs_kept`` runs
=================  ==========================  ==============================  ===========================
A browser is its ``kvscope_owner`` cookie (``app/web/security.py``: an id the server minted and signed). Besides
each browser's own cap, the browsers at one network address share at most ``address_share`` of each server-wide
cap (sessions and their bytes, pools, labs, the model queue, the labs' lines): ``Caps.shared`` (``app/quota.py``,
the one quota: at a cap it reclaims the least recently used idle object rather than refuse a newcomer). The
janitor thread (``start_janitor``) releases whatever expired every ``purge_interval_s`` and hands freed memory back
to the OS (``app/memory.py``: MKL's idle scratch pools and glibc's free pages).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from app.admission import ModelGate
from app.cache.paged_decode import PagedEngine
from app.labs.arena import ArenaLab, ArenaLimits
from app.labs.capacity import CapacityLab, CapacityLimits
from app.labs.decode import DecodeLab, DecodeLimits
from app.labs.engine import EngineLab, EngineLimits
from app.labs.explain import ExplainLab, ExplainLimits
from app.labs.export import ExportLab, ExportLimits
from app.labs.heads import HeadsLab, SurveyCache
from app.labs.inspect import InspectLab, InspectLimits
from app.labs.kit import KitLab, KitLimits
from app.labs.lesson import LessonLab
from app.labs.long import LongLab, LongLimits
from app.labs.paged import PagedLab, PagedLimits
from app.labs.patch import PatchLab, PatchLimits, result_bytes
from app.labs.prefix import PrefixLab, PrefixLabs, PrefixLimits
from app.labs.queue import LabQueue
from app.labs.served import ServedLab
from app.labs.speculative import SpecLimits, SpeculativeLab
from app.labs.train import TrainingLab, TrainLimits
from app.labs.zoom import ZoomLab, ZoomLimits
from app.memory import page_in, release_free_memory, tune_allocators
from app.model.loading import LoadedModel, ModelRegistry, load_registry, place
from app.model.sessions import SessionStore
from app.model.store import TraceStore
from app.model.trace import Trace
from app.owned import OwnedTable
from app.quota import NOBODY, Caps, Requester
from app.settings import Settings, resolve_device
from app.training.builtin import train_builtin

log = logging.getLogger("kvscope")


def load_models(settings: Settings, specs: tuple[str, ...] | None = None) -> ModelRegistry:
    """The models ``specs`` names (default ``settings.models``), the built-in one trained by
    ``app.training.builtin`` if its recipe changed (the model layer does not train)."""
    return load_registry(settings.models if specs is None else specs, settings.home, settings.hf_cache,
                         train_builtin=train_builtin)


def place_models(registry: ModelRegistry, settings: Settings) -> None:
    """Every served model's weights on ``Settings.device`` (``resolve_device``; nothing to do on the CPU)."""
    device = resolve_device(settings)
    if device != "cpu":
        for lm in registry.models.values():
            place(lm.model, device)


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
    # The labs, one per page (app/labs/), made in ``create`` from the pieces above.
    inspect: InspectLab = field(init=False)
    decode: DecodeLab = field(init=False)
    prefix: PrefixLabs = field(init=False)
    paged: PagedLab = field(init=False)
    heads: HeadsLab = field(init=False)
    arena: ArenaLab = field(init=False)
    training: TrainingLab = field(init=False)
    capacity: CapacityLab = field(init=False)
    lesson: LessonLab = field(init=False)
    speculative: SpeculativeLab = field(init=False)
    long: LongLab = field(init=False)
    zoom: ZoomLab = field(init=False)
    explain: ExplainLab = field(init=False)
    export: ExportLab = field(init=False)
    engine: EngineLab = field(init=False)
    patch: PatchLab = field(init=False)
    kit: KitLab = field(init=False)
    served: ServedLab = field(init=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _janitor: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def create(cls, settings: Settings, registry: ModelRegistry) -> AppState:
        s = settings
        ttl = s.session_ttl_s

        protect = s.quota_protect_s
        gate_limits = Caps.shared(max_items=s.queue_max_waiting, per_owner=s.queue_per_browser,
                                  share=s.address_share)
        state = cls(
            settings=s,
            registry=registry,
            traces=TraceStore(s.trace_cache_bytes, ttl_s=s.trace_ttl_s, keep_one_bytes=s.trace_keep_one_bytes,
                              browser_bytes=s.trace_browser_bytes, hold_s=s.trace_hold_s),
            sessions=SessionStore(ttl_s=ttl, max_steps=s.max_decode_steps, protect_s=protect,
                                  limits=Caps.shared(max_items=s.max_sessions, per_owner=s.max_sessions_per_browser,
                                                     share=s.address_share, max_bytes=s.session_cache_bytes)),
            paged_pools=OwnedTable(kind="pools", ttl_s=ttl, protect_s=protect,
                                   limits=Caps.shared(max_items=s.max_paged_pools,
                                                      per_owner=s.max_paged_pools_per_browser,
                                                      share=s.address_share, max_bytes=s.paged_cache_bytes)),
            prefix_labs=OwnedTable(kind="labs", ttl_s=ttl, protect_s=protect,
                                   limits=Caps.shared(max_items=s.max_prefix_labs, per_owner=1,
                                                      share=s.address_share, max_bytes=s.prefix_cache_bytes)),
            model_lock=ModelGate(max_waiting=s.queue_max_waiting, per_owner=s.queue_per_browser,
                                 max_wait_s=s.queue_max_wait_s, per_address=gate_limits.per_address,
                                 yield_long=s.queue_yield_long, short_tokens=s.queue_short_tokens,
                                 short_per_long=s.queue_short_per_long),
            head_surveys=SurveyCache(),
        )
        # Each lab gets its own limits (``XLimits.of``: its group in ``Settings.GROUPS``), never the whole Settings.
        gate = state.model_lock
        state.inspect = InspectLab(registry=registry, gate=gate, traces=state.traces, limits=InspectLimits.of(s))
        state.decode = DecodeLab(registry=registry, sessions=state.sessions, gate=gate, limits=DecodeLimits.of(s))
        state.prefix = PrefixLabs(registry=registry, gate=gate, labs=state.prefix_labs, limits=PrefixLimits.of(s))
        state.paged = PagedLab(registry=registry, gate=gate, pools=state.paged_pools, limits=PagedLimits.of(s))
        state.heads = HeadsLab(registry=registry, gate=gate, surveys=state.head_surveys)
        arena = ArenaLimits.of(s)
        state.arena = ArenaLab(registry=registry, limits=arena, line=state.lab_queue(
            "arena", max_run_s=arena.arena_max_s, cache_items=arena.arena_cache_runs))
        train = TrainLimits.of(s)
        state.training = TrainingLab(registry=registry, limits=train, home=s.home,
                                     line=state.lab_queue("train", max_run_s=train.train_max_s))
        state.capacity = CapacityLab(registry=registry, gate=gate, limits=CapacityLimits.of(s))
        state.speculative = SpeculativeLab(registry=registry, gate=gate, limits=SpecLimits.of(s))
        state.zoom = ZoomLab(inspect=state.inspect, limits=ZoomLimits.of(s))
        long = LongLimits.of(s)
        state.long = LongLab(inspect=state.inspect, zoom=state.zoom, limits=long,
                             line=state.lab_queue("long", max_run_s=long.long_capture_max_s))
        state.lesson = LessonLab(heads=state.heads, inspect=state.inspect, long=state.long)
        state.explain = ExplainLab(inspect=state.inspect, gate=gate, limits=ExplainLimits.of(s))
        state.export = ExportLab(inspect=state.inspect, limits=ExportLimits.of(s))
        state.engine = EngineLab(limits=EngineLimits.of(s))
        patch = PatchLimits.of(s)
        state.patch = PatchLab(registry=registry, limits=patch,
                               line=state.lab_queue("patch", max_run_s=patch.patch_max_s,
                                                    cache_bytes=patch.patch_cache_bytes, result_bytes=result_bytes))
        state.served = ServedLab(engine=state.engine, inspect=state.inspect, limits=EngineLimits.of(s))
        state.kit = KitLab(home=s.home, inspect=state.inspect, zoom=state.zoom, heads=state.heads, arena=state.arena,
                           speculative=state.speculative, limits=KitLimits.of(s))
        return state

    def lab_queue(self, name: str, *, max_run_s: float, cache_items: int = 0, cache_bytes: int = 0,
                  result_bytes=None) -> LabQueue:
        """A lab's line (``app/labs/queue.py``) with the server's limits, its runs taking the model gate."""
        s = self.settings
        shares = Caps.shared(max_items=s.lab_queue_max, per_owner=s.lab_jobs_per_browser, share=s.address_share)
        return LabQueue(name=name, gate=self.model_lock, max_queued=s.lab_queue_max, per_owner=s.lab_jobs_per_browser,
                        per_address=shares.per_address,
                        max_wait_s=s.lab_max_wait_s, max_run_s=max_run_s, cache_items=cache_items,
                        cache_bytes=cache_bytes, result_bytes=result_bytes)

    # --- models and traces (the Inspect lab's; other pages read the same traces) ---------------------------
    def model(self, name: str | None) -> LoadedModel:
        return self.registry.pick(name)

    def trace_prompt(self, model: str | None, prompt: str | None, *, chat: bool = False, who: Requester = NOBODY
                     ) -> tuple[LoadedModel, str, Trace]:
        """Inspect's ``trace_prompt`` for the server itself (``who``: nobody, unless a caller names a browser)."""
        return self.inspect.trace_prompt(model, prompt, who=who, chat=chat)

    def trace_key(self, lm: LoadedModel, ids: list[int] | tuple[int, ...]) -> str:
        """The key a trace of these tokens is kept and found under (``trace_by_key``)."""
        return self.inspect.trace_key(lm, ids)

    def compute_trace(self, lm: LoadedModel, ids: list[int]) -> Trace:
        """One capture, as the pages keep it (under the model gate)."""
        return self.inspect.compute_trace(lm, ids)

    def trace_by_key(self, key: str, *, who: Requester = NOBODY) -> tuple[LoadedModel, Trace]:
        return self.inspect.trace_by_key(key, who=who)

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
        """The server's background threads: the janitor, and one link per configured engine."""
        if self._janitor is not None:
            return
        self.engine.start()
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
        self.arena.line.close()
        self.training.line.close()
        self.long.line.close()
        self.engine.stop()
        self.patch.line.close()

    def stop_janitor(self) -> None:
        self._stop.set()
        if self._janitor is not None:
            self._janitor.join(timeout=5)
        self._janitor = None
