"""Inspect (/ and /api/trace…): a prompt captured once, then read panel by panel.

``InspectLab`` owns the captured traces, handed in by ``app/state.py``: the served models, the model gate, the
trace store (content-addressed, shared by every browser: the same model and tokens give the same key) and the
index from a key back to what made it, so a page's link recomputes a trace the store has dropped. A capture runs
under the model gate; everything else reads a trace already made.

    prepare(model, prompt)        tokenize and check, no model work: (model, ids, key)
    trace_prompt(model, prompt, who=)  tokenize, capture (or find) the trace: (model, key, trace)
    trace_by_key(key, who=)       the trace a page's link names (recomputed if dropped; 410 if its model went)

``who`` (``app/quota.py``'s ``Requester``, from the route) is the browser a trace computed for it is kept for.
    page / page_in_parts / trace_view / grid / attention / arithmetic / why / embedding / query_panels / embedding_panel
                                  what the routes call: plain view data out
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from app.admission import ModelGate, Withdrawn
from app.errors import Expired
from app.labs.limits import Limits
from app.model.capture import run_traced
from app.model.loading import LoadedModel, ModelRegistry
from app.model.prompts import encode_prompt
from app.model.store import LENS_POSITIONS, TraceStore, check_trace_fits, shape_only, slim, tail_only, trace_bytes
from app.model.trace import Trace
from app.quota import NOBODY, Requester
from app.viz.attention import GRID_SIDE, arithmetic, climb_part, embedding_rows, grid_thumbnails, head_matrix
from app.viz.inspect import check_selection, inspect_view, query_view
from app.viz.models import model_card
from app.viz.tokens import honest_texts, token_strip, unknown_note
from app.viz.why import why_attends

INDEX_KEYS = 10_000  # newest trace keys remembered (a key is ~100 bytes; an older link recomputes nothing: 410)


@dataclass(frozen=True)
class InspectLimits(Limits):
    """The prompt form's and the captures' bounds; the long prompts' form on the same page shows its own."""

    GROUP = "inspect"
    max_prompt_chars: int
    full_logits_max_tokens: int
    full_trace_max_tokens: int
    inspect_max_grid_size: int
    inspect_query_rows: int
    max_context_tokens: int
    trace_cache_bytes: int
    trace_keep_one_bytes: int
    zoom_min_tokens: int
    long_max_chars: int
    long_upload_bytes: int


class InspectLab:
    def __init__(self, *, registry: ModelRegistry, gate: ModelGate, traces: TraceStore, limits: InspectLimits) -> None:
        self.registry = registry
        self.gate = gate
        self.traces = traces
        self.limits = limits
        # trace key -> (model name, token ids, the model object it ran on): small, so it outlives the traces
        # themselves and lets an evicted trace be recomputed from a page's link.
        self.index: OrderedDict[str, tuple[str, tuple[int, ...], weakref.ref[LoadedModel]]] = OrderedDict()
        # Traces pinned for a class (app/labs/kit.py, keys ``kit-CODE``): read before the store, never expire and
        # never count against its budget (their tensors are memory-mapped from the kit's files).
        self.pinned: dict[str, tuple[LoadedModel, Trace]] = {}
        self._pin_lock = threading.Lock()

    # --- pins (``app/labs/pins.py``'s PinTarget) -----------------------------------------------------------------
    def pin(self, key: str, pinned: tuple[LoadedModel, Trace]) -> None:
        """Hold a pinned trace under ``key`` (read before the store, never expired)."""
        with self._pin_lock:
            self.pinned[key] = pinned

    def unpin(self, key: str) -> None:
        with self._pin_lock:
            self.pinned.pop(key, None)

    def pinned_item(self, key: str) -> tuple[LoadedModel, Trace] | None:
        with self._pin_lock:
            return self.pinned.get(key)

    # --- traces ---------------------------------------------------------------------------------------------
    def _key(self, lm: LoadedModel, ids: list[int] | tuple[int, ...]) -> str:
        # id(lm) makes a model loaded again under the same name (other weights) give other keys.
        digest = hashlib.sha256(f"{lm.name}|{id(lm)}|{','.join(map(str, ids))}".encode()).hexdigest()[:20]
        self.index[digest] = (lm.name, tuple(ids), weakref.ref(lm))
        self.index.move_to_end(digest)
        while len(self.index) > INDEX_KEYS:
            self.index.popitem(last=False)
        return digest

    def _compute(self, lm: LoadedModel, ids: list[int], on_layer: Callable[[int, Trace], None] | None = None,
                 cancel: threading.Event | None = None) -> Trace:
        long = len(ids) > self.limits.full_trace_max_tokens
        # A short prompt's capture runs between a long one's layers. ``cancel`` set (its page's client gone): the
        # wait for the gate ends, and so does the forward at its next layer (``on_layer`` raises ``Withdrawn``).
        with self.gate.for_tokens(len(ids), cancel):
            # Token texts as the pages show them: a byte piece of a multi-byte character by its byte values. What
            # ``slim`` drops is not held while the forward runs: activations by shape only, no copy of K/V in a cache,
            # a long prompt's per-position activations cut to its last positions as they are hooked.
            return slim(run_traced(lm.model, lm.adapter, ids, honest_texts(lm, ids), keep_cache=False,
                                   all_logits=len(ids) <= self.limits.full_logits_max_tokens,
                                   shape_only=shape_only, tail_only=tail_only if long else None,
                                   tail=LENS_POSITIONS if long else 0, on_layer=on_layer))

    def trace_key(self, lm: LoadedModel, ids: list[int] | tuple[int, ...]) -> str:
        """The key a trace of these tokens is kept and found under (``trace_by_key``)."""
        return self._key(lm, ids)

    def compute_trace(self, lm: LoadedModel, ids: list[int],
                      on_layer: Callable[[int, Trace], None] | None = None) -> Trace:
        """One capture, as the pages keep it (under the model gate); ``on_layer(i, part)``: each layer's attention
        as soon as it is computed (``run_traced``)."""
        return self._compute(lm, ids, on_layer)

    def expected_bytes(self, lm: LoadedModel, n_tokens: int) -> int:
        """What the trace of ``n_tokens`` will hold once kept (``trace_bytes``); room is made before its forward."""
        return trace_bytes(lm.adapter, n_tokens, full=n_tokens <= self.limits.full_trace_max_tokens)

    def prepare(self, model: str | None, prompt: str | None, *, chat: bool = False
                ) -> tuple[LoadedModel, list[int], str]:
        """A prompt checked and tokenized, before any model work: every error its own input can cause (the model's
        name, the length, the fit) is raised here. The model, the token ids, the trace's key."""
        lm = self.registry.pick(model)
        ids = encode_prompt(lm, prompt, max_chars=self.limits.max_prompt_chars, chat=chat)
        check_trace_fits(lm.adapter, len(ids), self.limits)
        return lm, ids, self._key(lm, ids)

    def trace_prompt(self, model: str | None, prompt: str | None, *, who: Requester, chat: bool = False
                     ) -> tuple[LoadedModel, str, Trace]:
        """``who``: the browser a newly computed trace is kept for (the store's per-browser budget)."""
        lm, ids, key = self.prepare(model, prompt, chat=chat)
        return lm, key, self.traces.get_or_compute(key, lambda: self._compute(lm, ids),
                                                   expected=self.expected_bytes(lm, len(ids)), owner=who.owner)

    def trace_by_key(self, key: str, *, who: Requester) -> tuple[LoadedModel, Trace]:
        """``who``: the browser the trace is kept for if it has to be computed again."""
        pinned = self.pinned.get(key)
        if pinned is not None:
            return self._served(*pinned)
        lm, ids = self._indexed(key)
        return lm, self.traces.get_or_compute(key, lambda: self._compute(lm, list(ids)),
                                              expected=self.expected_bytes(lm, len(ids)), owner=who.owner)

    def indexed(self, key: str) -> tuple[LoadedModel, tuple[int, ...]]:
        """The served model and the token ids ``key`` was made from (410 when they are gone); nothing computed."""
        return self._indexed(key)

    def _indexed(self, key: str) -> tuple[LoadedModel, tuple[int, ...]]:
        """The served model and the token ids a key was made from; 410 saying why when they are gone."""
        if key not in self.index:
            raise Expired("err.trace.expired")
        name, ids, ref = self.index[key]
        lm = self.registry.models.get(name)
        if lm is None:  # a trained model dropped since (Settings.max_trained_models)
            raise Expired("err.model.gone", model=name)
        if ref() is not lm:  # the model this view was made with is no longer served
            raise Expired("limits.model_changed", model=name)
        return lm, ids

    def _served(self, lm: LoadedModel, trace: Trace) -> tuple[LoadedModel, Trace]:
        if self.registry.models.get(lm.name) is not lm:
            raise Expired("err.model.gone", model=lm.name)
        return lm, trace

    def kept_trace(self, key: str) -> tuple[LoadedModel, Trace]:
        """The trace a key names if it is still computed (pinned, or in the store): never recomputed, so what a pin
        copies is what the browser saw; ``err.kit.gone`` (410) when it has been dropped."""
        pinned = self.pinned.get(key)
        if pinned is not None:
            return self._served(*pinned)
        lm, _ = self._indexed(key)

        def gone() -> Trace:
            raise Expired("err.kit.gone")

        return lm, self.traces.get_or_compute(key, gone, owner=NOBODY.owner)  # never computed: kept for nobody

    # --- views ----------------------------------------------------------------------------------------------
    def page(self, *, model: str | None, prompt: str | None, layer: int | None, head: int | None, q: int | None,
             kind: str, chat: bool, who: Requester) -> dict:
        """The page's context: the model's card, and with a prompt its whole view (``view`` None without)."""
        lm = self.registry.pick(model)
        view = None
        if prompt is not None:
            lm, key, trace = self.trace_prompt(model, prompt, who=who, chat=chat)
            view = inspect_view(lm, key, trace, layer=layer, head=head, q=q, kind=kind, prompt=prompt)
        card = view["model"] if view is not None else model_card(lm)  # the view's own card: made once per page
        return {"view": view, "prompt": prompt or "", "card": card, "chat": chat, "limits": self.limits}

    def page_in_parts(self, *, model: str | None, prompt: str, layer: int | None, head: int | None, q: int | None,
                      kind: str, chat: bool, who: Requester
                      ) -> tuple[dict, Callable[[Callable[[dict], None], threading.Event], dict]]:
        """``page`` in two parts, for a page sent while its prompt is captured (``app/web/render.py``
        ``render_in_parts``): the frame's context now, with every input checked (so a bad one is answered with its
        status before anything is sent), and ``view(emit, cancel)``, which captures the prompt and returns the view.

        While the capture climbs the model, ``emit`` is handed each layer as soon as it is computed (``climb_part``:
        its row of the all-heads grid; layer 0's matrix of the head the URL names, else head 0, and the URL's own
        head once its layer is in), the bytes the finished trace answers. A trace already kept (or being computed
        for another page) sends no layers: its view follows at once. ``cancel`` set: the capture stops at its next
        layer (``Withdrawn``) and nothing is kept."""
        lm, ids, key = self.prepare(model, prompt, chat=chat)
        check_selection(lm.adapter, len(ids), layer=layer, head=head, q=q, kind=kind)
        first = head or 0
        wanted = {0: (first,)}
        if layer is not None:
            wanted[layer] = tuple(sorted({*wanted.get(layer, ()), first}))
        if len(ids) > self.limits.zoom_min_tokens:  # a long prompt's head is the zoom map's tiles: the grid only
            wanted = {}

        def view(emit: Callable[[dict], None], cancel: threading.Event) -> dict:
            rows: list = []

            def on_layer(i: int, part: Trace) -> None:
                if cancel.is_set():
                    raise Withdrawn
                data, row = climb_part(part, i, wanted.get(i, ()), GRID_SIDE)
                rows.append(row)
                emit(data)

            def compute() -> Trace:
                trace = self._compute(lm, ids, on_layer, cancel)
                trace.meta["grid_rows"] = rows  # the grid's rows as the page already drew them (``grid``)
                return trace

            trace = self.traces.get_or_compute(key, compute, expected=self.expected_bytes(lm, len(ids)),
                                               owner=who.owner)
            return inspect_view(lm, key, trace, layer=layer, head=head, q=q, kind=kind, prompt=prompt)

        card = model_card(lm)
        # The token strip as the view will show it (it needs no forward), so the panels the climb fills stand where
        # the view's will: the view replaces them without moving the page.
        strip = {"n_tokens": len(ids), "model": card, "tokens": token_strip(ids, honest_texts(lm, ids)),
                 "unknown": unknown_note(lm, list(ids), prompt), "sel": {"q": len(ids) - 1 if q is None else q}}
        frame = {"view": None, "prompt": prompt, "card": card, "chat": chat, "limits": self.limits,
                 "climb": {"key": key, "layer": layer, "head": head, "strip": strip}}
        return frame, view

    def key_page(self, key: str, *, prompt: str, who: Requester) -> dict:
        """The page's context for a trace found by key (a pinned one: ``app/labs/kit.py``), as ``page`` makes it."""
        lm, trace = self.trace_by_key(key, who=who)
        view = inspect_view(lm, key, trace, prompt=prompt)
        return {"view": view, "prompt": prompt, "card": view["model"], "chat": False, "limits": self.limits}

    def trace_view(self, *, model: str | None, prompt: str, chat: bool, who: Requester) -> dict:
        lm, key, trace = self.trace_prompt(model, prompt, who=who, chat=chat)
        return inspect_view(lm, key, trace, prompt=prompt)

    def grid(self, key: str, size: int, *, who: Requester) -> dict:
        """Every layer × head as a small image of ``size`` pixels a side (4 to ``inspect_max_grid_size``)."""
        _, trace = self.trace_by_key(key, who=who)
        size = max(4, min(size, self.limits.inspect_max_grid_size))
        # Kept with the trace (the last size asked for, a few hundred KB at most): every browser that opens the
        # same link, and every reload, reads it instead of recomputing all the heads' weights. Two requests at
        # once may both compute it; they compute the same view.
        kept = trace.meta.get("grid")
        if kept is None or kept[0] != size:
            rows = trace.meta.get("grid_rows") if size == GRID_SIDE else None
            kept = trace.meta["grid"] = (size, grid_thumbnails(trace, size=size, layers=rows))
        return kept[1]

    def attention(self, key: str, layer: int, head: int, kind: str, encoding: str = "f32", *, who: Requester):
        _, trace = self.trace_by_key(key, who=who)
        return head_matrix(trace, layer, head, kind, encoding)

    def arithmetic(self, key: str, layer: int, head: int, q: int, *, who: Requester) -> dict:
        _, trace = self.trace_by_key(key, who=who)
        return arithmetic(trace, layer, head, q, limit=trace.n_tokens)

    def why(self, key: str, layer: int, head: int, q: int, k: int | None = None, *, who: Requester) -> dict:
        """One (query, key) score split by rotary pair (or dimension), with its content and position parts."""
        _, trace = self.trace_by_key(key, who=who)
        return why_attends(trace, layer, head, q, k)

    def embedding(self, key: str, pos: int, *, who: Requester) -> dict:
        _, trace = self.trace_by_key(key, who=who)
        return embedding_rows(trace, pos, first=None)

    def query_panels(self, key: str, *, layer: int, head: int, q: int, all_rows: bool, who: Requester) -> dict:
        """The embedding and arithmetic panels of one (layer, head, query token)."""
        lm, trace = self.trace_by_key(key, who=who)
        qv = query_view(trace, layer=layer, head=head, q=q,
                        limit=None if all_rows else self.limits.inspect_query_rows)
        return {"qv": qv, "key": key, "card": model_card(lm)}

    def embedding_panel(self, key: str, pos: int, *, who: Requester) -> dict:
        lm, trace = self.trace_by_key(key, who=who)
        return {"e": embedding_rows(trace, pos, first=None), "card": model_card(lm)}
