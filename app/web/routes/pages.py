"""The inspect page. Each route parses its query, calls one function, renders one template."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from app.viz.attention import embedding_rows
from app.viz.inspect import inspect_view, query_view
from app.viz.models import model_card
from app.web.deps import StateDep, is_htmx
from app.web.render import render

router = APIRouter(include_in_schema=False)


@router.get("/")
def read_inspect(
    request: Request,
    state: StateDep,
    prompt: str | None = None,
    model: str | None = None,
    layer: int | None = None,  # with neither layer nor head, the page opens on a telling head
    head: int | None = None,
    q: int | None = None,
    kind: str = "weights",
    chat: bool = False,  # the prompt as a user turn in the model's chat template
):
    lm = state.model(model)
    view = None
    if prompt is not None:
        lm, key, trace = state.trace_prompt(model, prompt, chat=chat)
        view = inspect_view(lm, key, trace, layer=layer, head=head, q=q, kind=kind, prompt=prompt)
    template = "partials/_inspect.html" if is_htmx(request) and view else "inspect.html"
    return render(request, template, view=view, prompt=prompt or "", card=model_card(lm), page="inspect",
                  chat=chat, chat_option=True)


@router.get("/inspect/{key}/query")
def read_query_panels(
    request: Request, state: StateDep, key: str, layer: int = 0, head: int = 0, q: int = Query(0),
    all_rows: bool = False,
):
    """The embedding and arithmetic panels for one (layer, head, query token): an htmx fragment."""
    lm, trace = state.trace_by_key(key)
    qv = query_view(trace, layer=layer, head=head, q=q, limit=None if all_rows else 48)
    return render(request, "partials/_query_panels.html", qv=qv, key=key, card=model_card(lm))


@router.get("/inspect/{key}/embedding/{pos}")
def read_embedding_panel(request: Request, state: StateDep, key: str, pos: int):
    """Every number of one token's wte row, wpe row and h0: an htmx fragment."""
    lm, trace = state.trace_by_key(key)
    return render(request, "partials/_embedding_full.html", e=embedding_rows(trace, pos, first=None),
                  card=model_card(lm))
