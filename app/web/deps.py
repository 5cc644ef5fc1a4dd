"""FastAPI dependencies: the app state and its parts, reached through ``request.app.state``."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.state import AppState


def get_state(request: Request) -> AppState:
    return request.app.state.kv


StateDep = Annotated[AppState, Depends(get_state)]


def is_htmx(request: Request) -> bool:
    return request.headers.get("HX-Request") == "true"
