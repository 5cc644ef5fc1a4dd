"""The guided lesson's stops for one model, in the page's language (static/lesson.js reads them)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.i18n import catalog, translator
from app.model.probes import head_facts
from app.viz.lesson import PROMPT, lesson_view
from app.viz.models import model_card
from app.web.deps import StateDep
from app.web.openapi import errors
from app.web.render import request_lang

router = APIRouter()


@router.get("/api/lesson", tags=["lesson"], responses=errors(422))
def read_lesson(request: Request, state: StateDep, model: str | None = None) -> dict:
    """Every stop of the lesson on "The cat sat on": page, highlighted element, text, the controls it drives."""
    lang = request_lang(request)
    lm = state.model(model)
    heads = head_facts(lm, PROMPT, lock=state.model_lock)  # measured once per model, then kept
    return lesson_view(model_card(lm), translator(lang), lambda key: key in catalog("en"), heads)
