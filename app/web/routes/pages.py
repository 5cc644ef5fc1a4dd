"""HTML pages. Each route parses its query, calls one function, renders one template."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.viz.inspect import inspect_view
from app.viz.models import model_card
from app.web.deps import StateDep, is_htmx
from app.web.render import render

router = APIRouter(include_in_schema=False)


@router.get("/")
def read_inspect(request: Request, state: StateDep, prompt: str | None = None, model: str | None = None):
    view = None
    if prompt is not None:
        lm, key, trace = state.trace_prompt(model, prompt)
        view = inspect_view(lm, key, trace)
    lm = state.model(model)
    template = "partials/_inspect.html" if is_htmx(request) and view else "inspect.html"
    return render(request, template, view=view, prompt=prompt or "", card=model_card(lm), page="inspect")
