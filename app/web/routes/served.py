"""Requests a real vLLM served, opened on Inspect (app/labs/served.py): fetched from an engine the server was started
with (picked by its index: no route takes an address), then shown by Inspect's own views under /served/{key}."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse
from pydantic import Field

from app.web.cancel import FollowResponse
from app.web.deps import OwnerDep, RequesterDep, ServedDep
from app.web.openapi import Body, errors
from app.web.render import render, request_lang

router = APIRouter()


class ServedBody(Body):
    name: str = Field(..., description="the capture's label (vllm_xargs kvscope_capture) or the engine's request id")


class AskBody(Body):
    prompt: str = Field(..., description="sent to the engine flagged for capture, then opened")
    before: str | None = Field(None, description="sent first, not captured: its full blocks land in the prefix cache")
    max_tokens: int = Field(4, description="new tokens the captured request decodes (engine_served_max_new_tokens)")


@router.post("/api/engine/{index}/served", tags=["engine"], responses=errors(404, 409, 410, 422, 502))
def open_served_api(lab: ServedDep, owner: OwnerDep, index: int, body: ServedBody) -> dict:
    """Fetch a flagged request's capture from engine ``index`` (the engine drops it once fetched) and hold it as a
    trace: its key and the page that shows it."""
    key = lab.open(index, body.name, owner)
    return {"key": key, "page": f"/served/{key}"}


@router.post("/api/engine/{index}/served/ask", tags=["engine"], responses=errors(404, 409, 410, 422, 502))
def ask_served_api(lab: ServedDep, owner: OwnerDep, index: int, body: AskBody) -> dict:
    """Send ``before`` (if given) then ``prompt`` to engine ``index``, the second flagged for capture, and hold its
    capture as a trace: its key and the page that shows it."""
    key = lab.ask(index, body.prompt, body.before, body.max_tokens, owner)
    return {"key": key, "page": f"/served/{key}"}


@router.post("/api/engine/{index}/served/follow", tags=["engine"], response_class=FollowResponse,
             responses=errors(404, 422))
async def follow_served_api(request: Request, lab: ServedDep, owner: OwnerDep, index: int,
                            body: AskBody) -> FollowResponse:
    """``/served/ask``, watched: one JSON line (``application/x-ndjson``) per change — ``sending``, ``rows`` (the
    forward steps every worker has captured, as [first position, rows], while the engine serves the request),
    then ``done`` (``result``: its key and page) or ``failed`` (``text``: why, in the request's language)."""
    look = lab.follow(index, body.prompt, body.before, body.max_tokens, request_lang(request), owner)
    return FollowResponse(look, is_last=lambda s: s["event"] in ("done", "failed"), poll_s=0.05, min_interval_s=0.05)


@router.post("/engine/served/ask", include_in_schema=False)
def ask_served_form(lab: ServedDep, owner: OwnerDep, index: Annotated[int, Form()], prompt: Annotated[str, Form()],
                    before: Annotated[str, Form()] = "", max_tokens: Annotated[int, Form()] = 4):
    return RedirectResponse(f"/served/{lab.ask(index, prompt, before, max_tokens, owner)}", status_code=303)


@router.post("/engine/served", include_in_schema=False)
def open_served_form(lab: ServedDep, owner: OwnerDep, index: Annotated[int, Form()], name: Annotated[str, Form()]):
    return RedirectResponse(f"/served/{lab.open(index, name, owner)}", status_code=303)


@router.get("/served/{key}", include_in_schema=False)
def read_served_page(request: Request, lab: ServedDep, who: RequesterDep, key: str):
    return render(request, "inspect.html", page="inspect", chat_option=False, **lab.page(key, who=who))
