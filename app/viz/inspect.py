"""View data for the inspect page, built from one trace."""

from __future__ import annotations

from app.errors import BadInput
from app.model.loading import LoadedModel
from app.model.sampling import top_candidates
from app.model.trace import Trace
from app.viz.attention import KINDS, arithmetic, check_bounds, check_indexes, embedding_rows
from app.viz.head_pick import choose_head
from app.viz.models import model_card
from app.viz.rotary import rotary_view
from app.viz.shapes import shape_groups
from app.viz.summaries import previous_token_shares, query_rows
from app.viz.tokens import candidate_rows, honest_texts, token_strip, unknown_note, visible


def query_view(trace: Trace, *, layer: int, head: int, q: int, limit: int | None = 48) -> dict:
    """Embeddings and the Q·K·V arithmetic for one query token."""
    check_indexes(trace, layer=layer, head=head, pos=q)
    return {
        "layer": layer,
        "head": head,
        "q": q,
        "embedding": embedding_rows(trace, q),
        "math": arithmetic(trace, layer, head, q, limit=limit or trace.n_tokens),
        "rotary": rotary_view(trace, layer, head, q) if trace.adapter.rotary else None,
    }


def opening_head(trace: Trace, q: int) -> dict:
    """The head a page opens on when its URL names none (``app.viz.head_pick``), for query ``q``: Inspect's and the
    zoom page's one choice. From q, k and the log-sum-exp: O(T) per head, no whole map. A reader's choice carries
    its two tokens' texts (``key_text``, ``query_text``) for the sentence saying why."""
    T = trace.n_tokens
    choice = choose_head(previous_token_shares(trace) if T >= 4 else None,
                         query_rows(trace, q) if 2 <= q < T else None, q)
    if choice["role"] == "reader":
        choice["key_text"] = visible(trace.token_texts[choice["key"]])
        choice["query_text"] = visible(trace.token_texts[q])
    return choice


def check_selection(adapter, n_tokens: int, *, layer: int | None, head: int | None, q: int | None,
                    kind: str) -> None:
    """What a page's URL selects (layer, head, query position, matrix kind), checked against the model and the
    prompt's length: before its capture (``InspectLab.page_in_parts``), and by ``inspect_view``."""
    if kind not in KINDS:
        raise BadInput("err.inspect.kind", kind=repr(kind), kinds=", ".join(KINDS))
    check_bounds(adapter, n_tokens, layer=layer, head=head, pos=q)


def inspect_view(
    lm: LoadedModel, key: str, trace: Trace, *, layer: int | None = None, head: int | None = None,
    q: int | None = None, kind: str = "weights", prompt: str | None = None,
) -> dict:
    """Everything the Inspect page shows for one trace; ``prompt`` (the text) lets the page name the
    characters that became ``<unk>``. With neither ``layer`` nor ``head`` given, the page opens on a telling
    head (``app.viz.head_pick``); with one given, the other is 0."""
    check_selection(trace.adapter, trace.n_tokens, layer=layer, head=head, q=q, kind=kind)
    q = trace.n_tokens - 1 if q is None else q
    choice = None
    if layer is None and head is None:
        choice = opening_head(trace, q)
        layer, head = choice["layer"], choice["head"]
    layer, head = layer or 0, head or 0
    sel = query_view(trace, layer=layer, head=head, q=q)
    return {
        "key": key,
        "model": model_card(lm),
        "n_tokens": trace.n_tokens,
        "tokens": token_strip(trace.token_ids, honest_texts(lm, trace.token_ids)),
        "unknown": unknown_note(lm, list(trace.token_ids), prompt),
        "shape_trace": shape_groups(trace.steps, trace.adapter, len(trace.token_ids)),
        "top_k": candidate_rows(lm, top_candidates(trace["probs"][0], k=10)),
        "sel": {"layer": layer, "head": head, "q": q, "kind": kind},
        "choice": choice if choice and choice["role"] else None,  # why the page opened on this head
        "query": sel,
        # A request a serving engine computed (app/engine/served_trace.py): its keys before this position came from
        # the engine's cached blocks (a prefix-cache hit), so the heatmap shades those columns. None otherwise.
        "cached_keys": (trace.meta.get("served") or {}).get("computed_from") or None,
    }
