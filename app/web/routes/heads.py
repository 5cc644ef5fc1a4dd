"""Head roles: /heads (the page) and /api/heads (its data). Every head of a model scored as previous-token,
induction, duplicate-token, first-token, self and local on one repeated random sequence
(``app/labs/heads.py`` computes it once per model under the model lock; ``app/viz/head_roles.py`` scores).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.web.deps import HeadsDep
from app.web.render import render

router = APIRouter()


@router.get("/heads", include_in_schema=False)
def read_heads_page(request: Request, lab: HeadsDep, model: str | None = None):
    return render(request, "heads.html", page="heads", **page_context(lab.view(model)))


def page_context(view: dict) -> dict:
    """What heads.html reads: the survey's view (the lab's, or a pinned one: /kit)."""
    return {"view": view}


@router.get("/api/heads", tags=["heads"])
def read_heads(lab: HeadsDep, model: str | None = None) -> dict:
    """Every (layer, head)'s score on each role, the strongest heads per role, the test sequence and, per head,
    the Inspect link that shows it on that sequence."""
    return lab.view(model)
