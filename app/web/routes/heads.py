"""Head roles: /heads (the page) and /api/heads (its data). Every head of a model scored as previous-token,
induction, duplicate-token, first-token, self and local on one repeated random sequence
(``app/model/head_survey.py`` computes it once per model under the model lock; ``app/viz/head_roles.py`` scores).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.viz.head_roles import head_roles_view
from app.web.deps import StateDep
from app.web.render import render

router = APIRouter()


def _view(state, model: str | None) -> dict:
    lm = state.model(model)
    survey = state.head_surveys.get(lm, state.model_lock)
    return head_roles_view(survey.scores, kv_map=lm.adapter.kv_map, model=lm.name, text=survey.text,
                           ids=survey.ids, token_texts=survey.token_texts, period=survey.period)


@router.get("/heads", include_in_schema=False)
def read_heads_page(request: Request, state: StateDep, model: str | None = None):
    return render(request, "heads.html", page="heads", view=_view(state, model))


@router.get("/api/heads", tags=["heads"])
def read_heads(state: StateDep, model: str | None = None) -> dict:
    """Every (layer, head)'s score on each role, the strongest heads per role, the test sequence and, per head,
    the Inspect link that shows it on that sequence."""
    return _view(state, model)
