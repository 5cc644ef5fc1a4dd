"""Inspect's explainers, each an htmx fragment of its own: attention sinks, the logit lens, head ablation. Each route
calls one method of ``ExplainLab`` (``app/labs/explain.py``) and renders its fragment."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.web.deps import ExplainDep, RequesterDep
from app.web.render import render

router = APIRouter(include_in_schema=False)


@router.get("/inspect/{key}/sinks")
def read_sinks(request: Request, lab: ExplainDep, who: RequesterDep, key: str, first: int = 1):
    """Per layer and head, the share of attention on the first ``first`` tokens."""
    return render(request, "partials/_sinks.html", **lab.sinks(key, first, who=who))


@router.get("/inspect/{key}/lens")
def read_lens(request: Request, lab: ExplainDep, who: RequesterDep, key: str):
    """Every layer's residual stream through the final norm and the unembedding."""
    return render(request, "partials/_lens.html", **lab.lens(key, who=who))


@router.get("/inspect/{key}/ablate")
def read_ablation(request: Request, lab: ExplainDep, who: RequesterDep, key: str, heads: str = ""):
    """The last position's top-k and logits with the chosen heads' outputs zeroed ('layer.head, ...')."""
    return render(request, "partials/_ablation.html", **lab.ablation(key, heads, who=who))
