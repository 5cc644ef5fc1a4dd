"""Long prompts on Inspect: a text (pasted, a .txt file, or the built-in long one) captured in its own line.

``LongLab`` holds the Inspect lab (whose traces it fills), its own line (``app/labs/queue.py``) and its limits
(``Settings.long_*``, ``max_context_tokens``).

    prepare(model, text, builtin)    the model and the token ids; over a limit -> BadInput naming it, before
                                     anything waits
    submit(lm, ids, who)             into ``line``: one long capture runs at a time, the others wait their turn; the
                                     same tokens already waiting or running are joined
    limits_view(model)               the limits the page's form shows
    layer_progress(adapter, pace)    a context manager: a forward hook per hook point reports "layer n of L" and
                                     stops the forward (``Stopped``) once the job is stopped
    climbed(job_id, layer, owner)    the capture watched as it climbs: layer ``layer``'s overview, made the moment
                                     the layer was computed (``app/viz/long_climb.py``), for the browsers that asked

The climb: while a capture runs, each finished layer's chosen head is pooled into the zoom page's opening overview
(its level-0 max tile), kept as bytes under the job's id, and the job's progress says how many are ready
(``climbed``), so the page draws layer after layer while the rest computes. Once the capture is done, each
overview seeds the zoom lab's pyramid of its head (the same cells its level-0 tile would pool), so opening the page
on one of them needs no pass over the map. A stopped or failed capture keeps none of it. ``CLIMBS`` captures' climbs
are kept (a 256 × 256 byte overview a layer).

Memory: the line runs one capture at a time, and before it starts it lets go of kept traces if they and the new
one would pass the trace budget (``max(trace_cache_bytes, trace_keep_one_bytes)``); the new trace's size is the
last long capture's bytes per token of this model times T (or, before the first, a lower bound: q, k and v of
every layer). So two long captures are never both in memory past the budget. A stopped capture raises out of the
forward: the hooks go (``capture``'s ``finally``), and what it had captured is dropped with the forward's frame.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from app.errors import BadInput, Expired, NotFound
from app.i18n import translate
from app.labs.inspect import InspectLab
from app.labs.limits import Limits
from app.labs.queue import GatedPace, Job, LabQueue
from app.labs.zoom import ZoomLab
from app.model.adapters import ModelAdapter, for_this_thread
from app.model.loading import LoadedModel
from app.model.prompts import encode_prompt
from app.model.store import trace_bytes
from app.model.trace import Trace
from app.quota import Requester
from app.viz.long_climb import LayerOverview, layer_overview

TOOK_KEYS = 256  # long captures whose time is remembered (a float each)
CLIMBS = 4  # long captures whose climb (one byte overview a layer, ~2 MB at 30 layers of 256 x 256) is kept
LONG_TEXT_PATH = Path(__file__).resolve().parents[1] / "model" / "long_reader.txt"


def long_text() -> str:
    """The built-in long text: an essay written for KVScope on how a reader keeps context (~8 000 SmolLM2 tokens)."""
    return LONG_TEXT_PATH.read_text(encoding="utf-8")


def essay_cut(lm: LoadedModel, ids: list[int]) -> int | None:
    """The built-in essay's whole length in ``lm``'s tokens where ``ids`` are its opening, cut shorter (to the
    model's or the server's limit); None for any other text, and for the whole essay."""
    essay = lm.encode(long_text())
    return len(essay) if len(ids) < len(essay) and essay[:len(ids)] == list(ids) else None


@contextmanager
def layer_progress(adapter: ModelAdapter, pace: GatedPace,
                   extra: Callable[[], dict] = dict) -> Iterator[None]:
    """While the block runs, each layer's first hook point reports ``layer`` (1-based) of ``layers`` to the job and
    checks its stop flag (``pace.step`` raises ``Stopped``, which ends the forward); once the logits are out, the
    phase after the last layer is named (``phase="heads"``: each head's q, k and v derived from what was captured,
    AFTER_LAYERS of the job's units). ``extra()``: more of the progress, said with each (the layers climbed). For
    this thread's forward only (a short one of another browser runs between the layers). Hooks removed in
    ``finally``."""
    layers = adapter.n_layer
    seen: set[int] = set()
    handles = []

    def after_last(*_):
        pace.step(0.0, phase="heads", layer=layers, layers=layers, **extra())

    def on_layer(layer: int):
        def hook(*_):
            if layer not in seen:
                seen.add(layer)
                pace.step(1.0, layer=layer + 1, layers=layers, **extra())

        return hook

    try:
        for point in adapter.hook_points():
            parts = point.name.split(".")
            if parts[0] == "blocks" and int(parts[1]) not in seen:
                handles.append(point.module.register_forward_pre_hook(for_this_thread(on_layer(int(parts[1])))))
                seen.add(int(parts[1]))
            elif point.name == "logits":
                handles.append(point.module.register_forward_hook(for_this_thread(after_last)))
        seen.clear()
        yield
    finally:
        for h in handles:
            h.remove()


def expected_bytes(lm: LoadedModel, n_tokens: int, full_trace_max_tokens: int) -> int:
    """What the trace of ``n_tokens`` will hold once kept (``trace_bytes``, from the model's sizes)."""
    return trace_bytes(lm.adapter, n_tokens, full=n_tokens <= full_trace_max_tokens)


def after_layers(n_layer: int) -> int:
    """The job's units for what runs after the last layer (each head's q, k, v derived from the captured tensors),
    in layers' worth: a third of the forward (measured on SmolLM2, 2 CPU cores: 9.5 s after 34 s of layers at 2 048
    tokens; ~40 s after ~100 s at 8 192), so the bar is not full while it runs."""
    return max(1, round(n_layer / 3))


def estimate(seconds: float | None) -> tuple[str, int]:
    """What capturing again takes, as a message says it: ("min", minutes) from 90 s, ("s", seconds), or
    ("unknown", 0) before anything was measured (a catalog key's suffix and its ``n``)."""
    if seconds is None:
        return "unknown", 0
    if seconds >= 90:
        return "min", round(seconds / 60)
    return "s", max(1, round(seconds))


def progress_text(progress: dict, lang: str) -> str:
    """"layer 3 of 30", or the phase after the last layer, in the request's language."""
    if progress.get("phase") == "heads":
        return translate("long.progress.heads", lang, layers=progress["layers"])
    return translate("long.progress", lang, layer=progress["layer"], layers=progress["layers"])


@dataclass(frozen=True)
class LongLimits(Limits):
    GROUP = "long"
    max_context_tokens: int
    full_trace_max_tokens: int
    long_max_chars: int
    long_upload_bytes: int
    long_capture_max_s: float
    zoom_min_tokens: int
    trace_hold_s: float
    trace_heartbeat_s: float
    trace_heartbeat_max_s: float


@dataclass
class Climb:
    """One capture's climb: the browsers that asked for it and each layer's overview so far (its meta, its bytes)."""

    owners: set[str]
    layers: list[tuple[dict, bytes]]


class LongLab:
    def __init__(self, *, inspect: InspectLab, zoom: ZoomLab, line: LabQueue, limits: LongLimits) -> None:
        self.inspect = inspect
        self.zoom = zoom
        self.line = line
        self.limits = limits
        # trace key -> seconds its capture took (the line's clock): what capturing it again is expected to take
        self._took: OrderedDict[str, float] = OrderedDict()
        self._climbs: OrderedDict[str, Climb] = OrderedDict()  # job id -> its climb (CLIMBS, oldest dropped)
        self._climb_lock = threading.Lock()

    def token_limit(self, lm: LoadedModel) -> int:
        return min(self.limits.max_context_tokens, lm.max_positions)

    def prepare(self, *, model: str | None, text: str | None, builtin: bool = False) -> tuple[LoadedModel, list[int]]:
        lim = self.limits
        lm = self.inspect.registry.pick(model)
        limit = self.token_limit(lm)
        if builtin and text:  # two texts asked for: reading one would ignore the other without a word
            raise BadInput("err.long.both")
        if builtin:  # the project's own text, cut to what the model reads
            return lm, lm.encode(long_text())[:limit]
        if text is not None and len(text.encode("utf-8")) > lim.long_upload_bytes:
            raise BadInput("err.long.bytes", n=f"{len(text.encode('utf-8')):,}", limit=f"{lim.long_upload_bytes:,}")
        ids = encode_prompt(lm, text, max_chars=lim.long_max_chars)
        if len(ids) > limit:
            raise BadInput("err.long.tokens", n=f"{len(ids):,}", model=lm.name, limit=f"{limit:,}")
        return lm, ids

    def submit(self, lm: LoadedModel, ids: list[int], *, who: Requester) -> Job:
        inspect = self.inspect
        key = inspect.trace_key(lm, ids)
        expected = expected_bytes(lm, len(ids), self.limits.full_trace_max_tokens)
        climb = Climb(owners={who.owner}, layers=[])
        overviews: list[LayerOverview] = []  # the float cells, to seed the zoom lab's pyramids once done

        def work(pace: GatedPace) -> dict:
            def on_layer(i: int, part: Trace) -> None:
                view = layer_overview(part, i)
                overviews.append(view)
                with self._climb_lock:
                    climb.layers.append((view.meta(), view.u8()))
                pace.step(0.0, **(pace.job.progress | {"climbed": len(climb.layers)}))  # said at once (and a stop)

            def capture():
                started = self.line.clock()
                trace = inspect.compute_trace(lm, ids, on_layer)
                self._took[key] = self.line.clock() - started
                while len(self._took) > TOOK_KEYS:
                    self._took.popitem(last=False)
                return trace

            try:
                # the store drops older traces first if this one needs the room
                with pace.piece(), layer_progress(lm.adapter, pace, lambda: {"climbed": len(climb.layers)}):
                    trace = inspect.traces.get_or_compute(key, capture, expected=expected,
                                                          owner=who.owner)  # kept for the browser that asked
            except BaseException:  # stopped, or failed: no half climb is shown
                self._drop_climb(pace.job.id)
                raise
            for view in overviews:
                self.zoom.seed_overview(key, trace, view.layer, view.head, view.cells)
            return {"key": key, "n_tokens": trace.n_tokens, "url": f"/zoom/{key}"}

        units = lm.adapter.n_layer + after_layers(lm.adapter.n_layer)
        job = self.line.submit(work, key=f"long:{key}", units=units, rate_key=lm.name, who=who, follow=True,
                               keep_alive=lm)
        with self._climb_lock:
            if job.work is work and not job.cached:  # a new capture: its climb is kept under its id
                self._climbs[job.id] = climb
                while len(self._climbs) > CLIMBS:
                    self._climbs.popitem(last=False)
            elif job.id in self._climbs:  # a browser joining a capture that climbs sees its climb too
                self._climbs[job.id].owners.add(who.owner)
        return job

    def _drop_climb(self, job_id: str) -> None:
        with self._climb_lock:
            self._climbs.pop(job_id, None)

    def climbed(self, job_id: str, layer: int, *, owner: str) -> tuple[dict, bytes]:
        """Layer ``layer``'s overview of a capture as it climbs: its meta (the head, why it was chosen, the cells'
        shape and positions per cell) and its cells as bytes (``LayerOverview.u8``). 404 for an unknown capture
        or another browser's; 422 for a layer not computed yet."""
        with self._climb_lock:
            climb = self._climbs.get(job_id)
            if climb is None or owner not in climb.owners:
                raise NotFound("err.long.climb.unknown")
            if not 0 <= layer < len(climb.layers):
                raise BadInput("err.long.climb.layer", layer=layer, n=len(climb.layers))
            return climb.layers[layer]

    def again(self, key: str) -> tuple[LoadedModel, list[int]]:
        """The model and tokens a trace's key was made from, to capture it again in the line (410 when gone)."""
        lm, ids = self.inspect.indexed(key)
        return lm, list(ids)

    def held(self, key: str) -> bool:
        """Whether the trace of ``key`` is held now (pinned, or kept by the store): opening it runs nothing."""
        return self.inspect.pinned_item(key) is not None or self.inspect.traces.holds(key)

    def dropped(self, key: str) -> dict | None:
        """None while the trace of ``key`` is held or is short (recomputed in a moment); for a long one the store
        dropped (idle past ``trace_hold_s``, or for memory): its size and what capturing it again takes --
        ``estimate_s``, this trace's own capture time when it was measured here, else the pace learned from the
        line's finished runs of this model, else None -- so the page says so before any long run starts."""
        if self.held(key):
            return None
        lm, ids = self.inspect.indexed(key)  # 410 when the key or its model is gone
        if len(ids) <= max(self.limits.zoom_min_tokens, self.limits.full_trace_max_tokens):
            return None
        took = self._took.get(key)
        units = lm.adapter.n_layer + after_layers(lm.adapter.n_layer)
        estimate = took if took is not None else self.line.learned_s(lm.name, units)
        return {"key": key, "model": lm.name, "n_tokens": len(ids), "estimate_s": estimate,
                "measured": took is not None}

    def heartbeat(self) -> dict:
        """How often a page showing a long trace says it is still open, for how long at most, and how long the
        trace is held after the last time (``Settings.trace_heartbeat_s``, ``trace_heartbeat_max_s``,
        ``trace_hold_s``)."""
        lim = self.limits
        return {"every_s": lim.trace_heartbeat_s, "max_s": lim.trace_heartbeat_max_s, "hold_s": lim.trace_hold_s}

    def hold(self, key: str) -> dict:
        """A page showing the trace of ``key`` is open (its heartbeat): held on (``TraceStore.touch``); a pinned
        one always is. 410 saying it was dropped, with what capturing it again takes, when it is gone."""
        if self.inspect.pinned_item(key) is not None:
            return {"held": True, "pinned": True}
        if self.inspect.traces.touch(key):
            return {"held": True, "pinned": False, "hold_s": self.inspect.traces.hold_s}
        gone = self.dropped(key) or {"estimate_s": None}
        unit, n = estimate(gone["estimate_s"])
        if unit == "min":
            raise Expired("err.trace.dropped.min", n=n)
        if unit == "s":
            raise Expired("err.trace.dropped.s", n=n)
        raise Expired("err.trace.dropped.unknown")

    def opening(self, lm: LoadedModel, n_tokens: int) -> str:
        """The built-in long text's first ``n_tokens`` tokens of ``lm`` (fewer where the model reads fewer), as text
        the long-prompt form takes back (the guided lesson's long-context stop types it there)."""
        limit = min(n_tokens, self.token_limit(lm))
        # one sequence of ids decodes to one string (transformers types decode's result str | list[str])
        text = cast(str, lm.tokenizer.decode(lm.encode(long_text())[:limit], clean_up_tokenization_spaces=False))
        while len(lm.encode(text)) > limit:  # a cut inside a word may encode to one token more
            text = text[:-8]
        return text

    def stop(self, job_id: str, owner: str) -> bool:
        return self.line.stop(job_id, owner)

    def limits_view(self, model: str | None) -> dict:
        """The long prompts' limits for ``model``: its tokens, the characters, a file's bytes, where the zoom starts."""
        lim = self.limits
        lm = self.inspect.registry.pick(model)
        return {"model": lm.name, "max_tokens": self.token_limit(lm), "max_chars": lim.long_max_chars,
                "max_bytes": lim.long_upload_bytes, "zoom_min_tokens": lim.zoom_min_tokens}
