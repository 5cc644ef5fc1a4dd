"""Long prompts on Inspect: a text (pasted, a .txt file, or the built-in long one) captured in its own line.

    prepare(state, model, text, builtin)   the model and the token ids; over a limit -> BadInput naming it, before
                                           anything waits
    submit(state, lm, ids, owner, address) into ``state.long_line`` (``app/labs/queue.py``): one long capture runs
                                           at a time, the others wait their turn; the same tokens already waiting
                                           or running are joined
    layer_progress(adapter, pace)          a context manager: a forward hook per hook point reports "layer n of L"
                                           and stops the forward (``Stopped``) once the job is stopped

Memory: the line runs one capture at a time, and before it starts it lets go of kept traces if they and the new
one would pass the trace budget (``max(trace_cache_bytes, trace_keep_one_bytes)``); the new trace's size is the
last long capture's bytes per token of this model times T (or, before the first, a lower bound: q, k and v of
every layer). So two long captures are never both in memory past the budget. A stopped capture raises out of the
forward: the hooks go (``capture``'s ``finally``), and what it had captured is dropped with the forward's frame.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.errors import BadInput
from app.i18n import translate
from app.labs.queue import GatedPace, Job
from app.model.adapters import ModelAdapter
from app.model.loading import LoadedModel
from app.model.prompts import encode_prompt
from app.model.store import trace_bytes

LONG_TEXT_PATH = Path(__file__).resolve().parents[1] / "model" / "long_reader.txt"


def long_text() -> str:
    """The built-in long text: an essay written for KVScope on how a reader keeps context (~8 000 SmolLM2 tokens)."""
    return LONG_TEXT_PATH.read_text(encoding="utf-8")


def token_limit(state, lm: LoadedModel) -> int:
    return min(state.settings.max_context_tokens, lm.max_positions)


def prepare(state, *, model: str | None, text: str | None, builtin: bool = False) -> tuple[LoadedModel, list[int]]:
    s = state.settings
    lm = state.model(model)
    limit = token_limit(state, lm)
    if builtin and text:  # two texts asked for: reading one would ignore the other without a word
        raise BadInput("err.long.both")
    if builtin:  # the project's own text, cut to what the model reads
        return lm, lm.encode(long_text())[:limit]
    if text is not None and len(text.encode("utf-8")) > s.long_upload_bytes:
        raise BadInput("err.long.bytes", n=f"{len(text.encode('utf-8')):,}", limit=f"{s.long_upload_bytes:,}")
    ids = encode_prompt(lm, text, max_chars=s.long_max_chars)
    if len(ids) > limit:
        raise BadInput("err.long.tokens", n=f"{len(ids):,}", model=lm.name, limit=f"{limit:,}")
    return lm, ids


@contextmanager
def layer_progress(adapter: ModelAdapter, pace: GatedPace) -> Iterator[None]:
    """While the block runs, each layer's first hook point reports ``layer`` (1-based) of ``layers`` to the job and
    checks its stop flag (``pace.step`` raises ``Stopped``, which ends the forward). Hooks removed in ``finally``."""
    layers = adapter.n_layer
    seen: set[int] = set()
    handles = []

    def on_layer(layer: int):
        def hook(*_):
            if layer not in seen:
                seen.add(layer)
                pace.step(1.0, layer=layer + 1, layers=layers)

        return hook

    try:
        for point in adapter.hook_points():
            parts = point.name.split(".")
            if parts[0] == "blocks" and int(parts[1]) not in seen:
                handles.append(point.module.register_forward_pre_hook(on_layer(int(parts[1]))))
                seen.add(int(parts[1]))
        seen.clear()
        yield
    finally:
        for h in handles:
            h.remove()


def expected_bytes(lm: LoadedModel, n_tokens: int, settings) -> int:
    """What the trace of ``n_tokens`` will hold once kept (``trace_bytes``, from the model's sizes)."""
    return trace_bytes(lm.adapter, n_tokens, full=n_tokens <= settings.full_trace_max_tokens)


def submit(state, lm: LoadedModel, ids: list[int], *, owner: str, address: str) -> Job:
    key = state.trace_key(lm, ids)

    def work(pace: GatedPace) -> dict:
        # the store drops older traces first if this one needs the room
        with pace.piece(), layer_progress(lm.adapter, pace):
            trace = state.traces.get_or_compute(key, lambda: state.compute_trace(lm, ids),
                                                expected=expected_bytes(lm, len(ids), state.settings))
        return {"key": key, "n_tokens": trace.n_tokens, "url": f"/zoom/{key}"}

    return state.long_line.submit(work, key=f"long:{key}", units=lm.adapter.n_layer, rate_key=lm.name, owner=owner,
                                  address=address, follow=True, keep_alive=lm)


def progress_text(progress: dict, lang: str) -> str:
    """"layer 3 of 30" in the request's language."""
    return translate("long.progress", lang, layer=progress["layer"], layers=progress["layers"])


def limits(state, model: str | None) -> dict:
    s = state.settings
    lm = state.model(model)
    return {"model": lm.name, "max_tokens": token_limit(state, lm), "max_chars": s.long_max_chars,
            "max_bytes": s.long_upload_bytes, "zoom_min_tokens": s.zoom_min_tokens}
