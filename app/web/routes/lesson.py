"""The guided lesson's stops for one model, in the page's language (static/lesson.js reads them)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.web.deps import LessonDep, RequesterDep
from app.web.openapi import errors
from app.web.render import request_lang

router = APIRouter()


@router.get("/api/lesson", tags=["lesson"], responses=errors(422))
def read_lesson(request: Request, lab: LessonDep, who: RequesterDep, model: str | None = None) -> dict:
    """Every stop of the lesson on "The cat sat on": page, highlighted element, text, the controls it drives."""
    return lab.view(model, request_lang(request), who=who)
