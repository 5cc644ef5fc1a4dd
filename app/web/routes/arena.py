"""The compression arena: /arena (the page; with a query, the run as a fragment or a full page), and its API:
/api/arena/jobs (a run followed live), /api/arena/run (the numbers once done), Stop.

Runs take seconds of model time: they are bounded by ``Settings.arena_*`` and wait their turn in the arena's
line (``app/labs/arena.py``, which owns the line, the limits and the view), a forward per hold of the model gate;
an identical request is answered from the finished results. A run whose client has gone is stopped.
"""

from __future__ import annotations

from typing import Literal

import anyio.to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import Field

from app.labs.arena import DEFAULT_POLICIES, ArenaLab
from app.quota import Requester
from app.viz.labs import arena_progress
from app.web.cancel import FollowResponse
from app.web.deps import ArenaDep, OwnerDep, RequesterDep, is_htmx
from app.web.labs import follow_job, wait_job
from app.web.openapi import Body, errors
from app.web.render import render

router = APIRouter()

class ArenaRun(Body):
    model: str | None = None
    source: Literal["text", "prompt"] = "text"
    prompt: str | None = Field(None, max_length=20_000)
    steps: int = 16
    budget_kind: Literal["percent", "bytes"] = "percent"
    budget: float = 25.0
    policies: list[str] = Field(default_factory=lambda: list(DEFAULT_POLICIES))
    go_on: bool = Field(False, description="a prompt's continuation goes on past the model's end token (default: "
                                           "full attention's greedy continuation, and so the run, ends there)")


async def _prepare(lab: ArenaLab, body: ArenaRun):
    """The model and the checked request (422 on bad input), tokenized off the event loop."""
    return await anyio.to_thread.run_sync(lambda: lab.prepare(**body.model_dump()))


async def _run(request: Request, lab: ArenaLab, body: ArenaRun, who: Requester, shown: bool = False):
    """Wait for the run's numbers (from the finished results at once, or after its turn in the line). ``shown``:
    the page showing a run it followed, which may have stopped at the time limit with what it had (partial)."""
    lm, req = await _prepare(lab, body)
    run = lab.cached(lm, req) if shown else None
    if run is None:
        job = lab.submit(lm, req, who=who)
        run = await wait_job(request, lab.line, job, who.owner)
    return lm, (None if run is None else await anyio.to_thread.run_sync(lab.view, lm, run))


@router.get("/arena", include_in_schema=False)
async def read_arena(
    request: Request, lab: ArenaDep, who: RequesterDep, model: str | None = None,
    source: Literal["text", "prompt"] | None = None, prompt: str | None = None, steps: int = 16,
    budget_kind: Literal["percent", "bytes"] = "percent", budget: float = 25.0,
    policies: list[str] = Query(default=list(DEFAULT_POLICIES)), go_on: bool = False,
):
    """The page. With a query: htmx gets the run's fragment (after its turn in the line); a full page shows the
    result if it is already finished, else the form, whose script then runs it with a place in line."""
    lm = lab.registry.pick(model)
    form = ArenaRun(model=model, source=source or "text", prompt=prompt, steps=steps, budget_kind=budget_kind,
                    budget=budget, policies=policies, go_on=go_on)
    view, pending = None, False
    if source is not None and is_htmx(request):
        lm, view = await _run(request, lab, form, who, shown=True)
        if view is None:  # the client has gone
            return Response(status_code=204)
    elif source is not None:
        lm, req = await _prepare(lab, form)
        run = lab.cached(lm, req)
        view = None if run is None else await anyio.to_thread.run_sync(lab.view, lm, run)
        pending = run is None
    fragment = is_htmx(request) and view is not None
    template = "partials/_arena_result.html" if fragment else "arena.html"
    return render(request, template, page="arena", **page_context(lab.page(lm), form=form, view=view, oob=fragment,
                                                                  pending=pending))


def page_context(page: dict, *, form, view: dict | None = None, oob: bool = False, pending: bool = False) -> dict:
    """What arena.html reads: the lab's page, the form as filled, a run's view (a pinned one: /kit), whether the
    result is swapped in out of band (an htmx fragment) and whether the page's script still has to run it."""
    return {"view": view, "form": form, "oob": oob, "pending": pending, **page}


@router.post("/api/arena/jobs", tags=["arena"], response_class=FollowResponse, responses=errors(422, 429, 503))
async def follow_arena_run(request: Request, lab: ArenaDep, who: RequesterDep,
                           body: ArenaRun) -> FollowResponse:
    """Run the arena, followed live: one JSON line per change (``application/x-ndjson``). ``event`` is
    ``queued`` (``place`` in line, ``eta_s``), ``running`` (``progress``: policy i of n, step s of steps;
    ``fraction``), then ``done`` (``cached``: an identical request had finished, no model work), ``stopped``
    (``reason``), ``replaced`` (a newer run of this browser) or ``failed``; ``text`` says it in the request's
    language. A browser has one run in the line: a new one replaces it. Closing the connection stops the run
    (unless another browser asked for the same). The numbers: ``/api/arena/run`` with the same body, at once."""
    lm, req = await _prepare(lab, body)
    job = lab.submit(lm, req, who=who)
    return follow_job(request, lab.line, job, who.owner, arena_progress)


@router.post("/api/arena/run", tags=["arena"], responses=errors(422, 429, 503))
async def run_arena_api(request: Request, lab: ArenaDep, who: RequesterDep,
                        body: ArenaRun) -> dict:
    """Every chosen policy against full attention on one prompt: per-step KL, agreement, perplexity, attention mass,
    kept maps, bytes held, first divergence (the page's numbers). Waits its turn in the arena's line (an identical
    finished request answers at once); stopped if the client disconnects."""
    return (await _run(request, lab, body, who))[1] or {}


@router.delete("/api/arena/jobs/{job_id}", tags=["arena"])
def stop_arena_run(lab: ArenaDep, owner: OwnerDep, job_id: str) -> dict:
    """Stop: this browser leaves the run; a waiting run nobody else asked for leaves the line, a running one stops
    after its current forward. ``stopped`` is false for an unknown, finished or other browser's run."""
    return lab.stop(job_id, owner)


@router.post("/api/arena/jobs/{job_id}/stop", tags=["arena"])
def stop_arena_run_beacon(lab: ArenaDep, owner: OwnerDep, job_id: str) -> dict:
    """The same as DELETE, for navigator.sendBeacon when a page closes."""
    return lab.stop(job_id, owner)
