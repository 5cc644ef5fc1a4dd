"""Requests a real vLLM served, opened on Inspect (app/labs/served.py): fetched from an engine the server was started
with (picked by its index: no route takes an address), then shown by Inspect's own views under /served/{key}."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse
from pydantic import Field

from app.web.deps import ServedDep
from app.web.openapi import Body, errors
from app.web.render import render

router = APIRouter()


class ServedBody(Body):
    name: str = Field(..., description="the capture's label (vllm_xargs kvscope_capture) or the engine's request id")


@router.post("/api/engine/{index}/served", tags=["engine"], responses=errors(404, 409, 410, 422, 502))
def open_served_api(lab: ServedDep, index: int, body: ServedBody) -> dict:
    """Fetch a flagged request's capture from engine ``index`` (the engine drops it once fetched) and hold it as a
    trace: its key and the page that shows it."""
    key = lab.open(index, body.name)
    return {"key": key, "page": f"/served/{key}"}


@router.post("/engine/served", include_in_schema=False)
def open_served_form(lab: ServedDep, index: Annotated[int, Form()], name: Annotated[str, Form()]):
    return RedirectResponse(f"/served/{lab.open(index, name)}", status_code=303)


@router.get("/served/{key}", include_in_schema=False)
def read_served_page(request: Request, lab: ServedDep, key: str):
    return render(request, "inspect.html", page="inspect", chat_option=False, **lab.page(key))
