"""The inspect page. Each route parses its query, calls one function, renders one template."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from app.web.deps import InspectDep, RequesterDep, is_htmx
from app.web.render import render, render_in_parts

router = APIRouter(include_in_schema=False)
CLIMB_HEADER = "X-KVScope-Climb"  # static/climb.js: the htmx request of a prompt typed on the page


@router.get("/")
def read_inspect(
    request: Request,
    lab: InspectDep,
    who: RequesterDep,
    prompt: str | None = None,
    model: str | None = None,
    layer: int | None = None,  # with neither layer nor head, the page opens on a telling head
    head: int | None = None,
    q: int | None = None,
    kind: str = "weights",
    chat: bool = False,  # the prompt as a user turn in the model's chat template
):
    # The page's frame first, its view once the prompt is captured; a prompt typed on the page (its form's htmx
    # request, marked by static/climb.js) gets the same stream without the page around it.
    typed = is_htmx(request) and request.headers.get(CLIMB_HEADER) == "1"
    if prompt is not None and (typed or not is_htmx(request)):
        frame, fill = lab.page_in_parts(model=model, prompt=prompt, layer=layer, head=head, q=q, kind=kind, chat=chat,
                                          who=who)
        if typed:
            return render_in_parts(request, "partials/_climb_stream.html", "partials/_inspect.html", fill,
                                   part="partials/_climb_layer.html", typed=True, chat_option=True, **frame)
        return render_in_parts(request, "inspect.html", "partials/_inspect_page.html", fill,
                               part="partials/_climb_layer.html", page="inspect", chat_option=True, **frame)
    page = lab.page(model=model, prompt=prompt, layer=layer, head=head, q=q, kind=kind, chat=chat, who=who)
    template = "partials/_inspect.html" if is_htmx(request) and page["view"] else "inspect.html"
    return render(request, template, page="inspect", chat_option=True, **page)


@router.get("/inspect/{key}/query")
def read_query_panels(
    request: Request, lab: InspectDep, who: RequesterDep, key: str, layer: int = 0, head: int = 0, q: int = Query(0),
    all_rows: bool = False,
):
    """The embedding and arithmetic panels for one (layer, head, query token): an htmx fragment."""
    return render(request, "partials/_query_panels.html",
                  **lab.query_panels(key, layer=layer, head=head, q=q, all_rows=all_rows, who=who))


@router.get("/inspect/{key}/embedding/{pos}")
def read_embedding_panel(request: Request, lab: InspectDep, who: RequesterDep, key: str, pos: int):
    """Every number of one token's wte row, wpe row and h0: an htmx fragment."""
    return render(request, "partials/_embedding_full.html", **lab.embedding_panel(key, pos, who=who))
