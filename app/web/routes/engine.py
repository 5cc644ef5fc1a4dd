"""The Engine page: /engine, and its JSON under /api/engine/ (snapshots, a live NDJSON stream, drive and compare,
the fleet's routing). Engines are picked by their index among those the server was started with; none of these
routes takes an address."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from app.i18n import catalog
from app.labs.served import ASK_BEFORE, ASK_PROMPT
from app.web.deps import EngineDep, OwnerDep
from app.web.openapi import Body, errors
from app.web.render import render, request_lang

router = APIRouter()
# Every "engine." string of the catalog: the page's script words its live views with them.
SCRIPT_KEYS = tuple(k for k in catalog("en") if k.startswith("engine."))


class DriveBody(Body):
    engine: int = Field(0, ge=0, le=1023, description="which configured engine (its index)")
    preset: Literal["system", "chat", "timestamp"] = "system"


class RouteBody(Body):
    prompt: str  # at most KVSCOPE_MAX_PROMPT_CHARS characters (checked by the lab)


@router.get("/engine", include_in_schema=False)
def read_engine_page(request: Request, lab: EngineDep, owner: OwnerDep):
    lang = request_lang(request)
    return render(request, "engine.html", page="engine", script_keys=SCRIPT_KEYS, **lab.page(lang),
                  last_run=lab.last_run(owner), ask={"before": ASK_BEFORE, "prompt": ASK_PROMPT,
                                                     "max_tokens": lab.limits.engine_served_max_new_tokens})


@router.get("/api/engine/fleet", tags=["engine"], responses=errors(404))
def read_fleet(request: Request, lab: EngineDep) -> dict:
    """Which engine holds which prefix: every engine's chains of cached blocks (its live events), decoded, merged."""
    return lab.fleet(request_lang(request))


@router.get("/api/engine/{index}", tags=["engine"], responses=errors(404))
def read_engine(request: Request, lab: EngineDep, index: int) -> dict:
    """Engine ``index`` as KVScope mirrors it: status, metrics, its blocks as a prefix tree (newest shown)."""
    return lab.snapshot(index, request_lang(request))


@router.get("/api/engine/{index}/calculator", tags=["engine"], responses=errors(404))
def read_calculator_line(lab: EngineDep, index: int) -> dict:
    """KVScope's capacity calculator on the engine's configuration, beside the engine's ``cache_config_info``."""
    return lab.calculator_line(lab.link(index)) or {"model": None}


class FollowBody(Body):
    since: int = Field(-1, ge=-1, description="the mirror version the page has (-1: none yet)")


@router.post("/api/engine/{index}/stream", tags=["engine"], responses=errors(404, 503))
async def follow_engine(request: Request, lab: EngineDep, index: int, body: FollowBody) -> StreamingResponse:
    """One JSON snapshot a line, whenever the engine's blocks or metrics change (NDJSON), for a few minutes.
    (Async: the stream registers with this event loop before the response starts, so a refusal is a 503.)"""
    return StreamingResponse(lab.stream(index, request_lang(request), body.since),
                             media_type="application/x-ndjson")


@router.post("/api/engine/drive", tags=["engine"], responses=errors(404, 422, 503))
def drive_engine(request: Request, lab: EngineDep, owner: OwnerDep, body: DriveBody) -> dict:
    """Send a preset's requests to the engine and the same through KVScope's own block pool; side by side."""
    return lab.drive(body.engine, body.preset, owner, request_lang(request))


@router.post("/api/engine/route", tags=["engine"], responses=errors(404, 422))
def route_prompt(request: Request, lab: EngineDep, body: RouteBody) -> dict:
    """For each engine: how many leading blocks of this prompt it holds now, and the engine a KV-aware router picks
    (the highest score in tokens; a tie named and broken by KV usage, then index)."""
    return lab.route(body.prompt, request_lang(request))
