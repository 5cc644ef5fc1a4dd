"""The guided lesson's stops for one model, in the page's language (static/lesson.js reads them)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.errors import BadInput
from app.i18n import catalog, translator
from app.viz.explain import sinks_view
from app.viz.lesson import PROMPT, lesson_view, measured_heads
from app.viz.models import model_card
from app.viz.summaries import first_token_shares
from app.web.deps import StateDep
from app.web.openapi import errors
from app.web.render import request_lang

router = APIRouter()


@router.get("/api/lesson", tags=["lesson"], responses=errors(422))
def read_lesson(request: Request, state: StateDep, model: str | None = None) -> dict:
    """Every stop of the lesson on "The cat sat on": page, highlighted element, text, the controls it drives."""
    lang = request_lang(request)
    lm = state.model(model)
    try:  # the head-roles survey, computed once per model (the /heads page's)
        roles = state.head_surveys.get(lm, state.model_lock).scores
    except BadInput:  # a vocabulary the survey cannot build its sequence from: no sentences about roles
        roles = None
    _, _, trace = state.trace_prompt(lm.name, PROMPT)  # the trace Inspect shows at the lesson's first stops
    sinks = sinks_view(first=1, token_texts=trace.token_texts, shares=first_token_shares(trace, 1))
    return lesson_view(model_card(lm), translator(lang), lambda key: key in catalog("en"),
                       measured_heads(roles, sinks))
