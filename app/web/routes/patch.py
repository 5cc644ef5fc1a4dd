"""Activation patching: /patch (the page) and its API: /api/patch/jobs (a map followed live), /api/patch/run (the
map's numbers once done), Stop.

A map takes tens of forwards: bounded by ``Settings.patch_*``, they wait their turn in the lab's line
(``app/labs/patch.py``, which owns the line, the limits and the view), a forward per hold of the model gate; an
identical request is answered from the finished maps. A run whose client has gone is stopped.
"""

from __future__ import annotations

from typing import Literal

import anyio.to_thread
from fastapi import APIRouter, Request
from pydantic import Field

from app.labs.patch import PatchLab
from app.viz.patch import patch_progress
from app.web.cancel import FollowResponse
from app.web.deps import OwnerDep, PatchDep, RequesterDep
from app.web.labs import follow_job, wait_job
from app.web.openapi import Body, errors
from app.web.render import render

router = APIRouter()

SCRIPT_KEYS = (
    "patch.axis.block", "patch.axis.position", "patch.axis.head", "patch.colour.normalized", "patch.colour.prob",
    "patch.hover.cell", "patch.hover.raw", "patch.what.resid", "patch.what.attn", "patch.what.mlp", "patch.what.head",
    "patch.what.head_pos", "patch.summary", "patch.summary.prob", "patch.answer.first", "patch.answer.scored",
    "patch.answer.space",
    "patch.answer.use_space", "patch.open_inspect",
    "patch.differ", "patch.direction.denoise.means", "patch.direction.noise.means", "patch.prob.means",
)


class PatchRun(Body):
    model: str | None = None
    clean: str = Field("", max_length=20_000)
    corrupted: str = Field("", max_length=20_000)
    answer: str = Field("", max_length=200)
    wrong: str = Field("", max_length=200)
    metric: Literal["logit_diff", "prob"] = "logit_diff"
    direction: Literal["denoise", "noise"] = "denoise"
    kind: Literal["resid", "attn", "mlp", "head", "head_pos"] = "resid"
    layer: int | None = Field(None, ge=0, le=10_000)
    head: int | None = Field(None, ge=0, le=10_000)


async def _prepare(lab: PatchLab, body: PatchRun):
    """The model and the checked request (422 on bad input), tokenized off the event loop."""
    return await anyio.to_thread.run_sync(lambda: lab.prepare(**body.model_dump()))


@router.get("/patch", include_in_schema=False)
def read_patch(request: Request, lab: PatchDep, model: str | None = None):
    """The page: the form (presets, the user's own prompts); its script runs the map and draws it."""
    return render(request, "patch.html", page="patch", script_keys=SCRIPT_KEYS, **lab.page(model))


@router.post("/api/patch/jobs", tags=["patch"], response_class=FollowResponse, responses=errors(422, 429, 503))
async def follow_patch_run(request: Request, lab: PatchDep, who: RequesterDep,
                           body: PatchRun) -> FollowResponse:
    """Compute a patching map, followed live: one JSON line per change (``application/x-ndjson``). ``event`` is
    ``queued`` (``place``, ``eta_s``), ``running`` (``progress``: forwards ``done`` of ``total``; ``fraction``), then
    ``done`` (``cached``: an identical request had finished), ``stopped``, ``replaced`` or ``failed``; ``text`` says
    it in the request's language. Closing the connection stops the run. The numbers: ``/api/patch/run``."""
    lm, req = await _prepare(lab, body)
    job = lab.submit(lm, req, who=who)
    return follow_job(request, lab.line, job, who.owner, patch_progress)


@router.post("/api/patch/run", tags=["patch"], responses=errors(422, 429, 503))
async def run_patch_api(request: Request, lab: PatchDep, who: RequesterDep,
                        body: PatchRun) -> dict:
    """The map: each cell's metric with that activation patched (normalized logit difference or probability), the
    clean and corrupted runs' metrics, the tokens, the answer tokens used. Waits its turn in the lab's line (an
    identical finished request answers at once); stopped if the client disconnects."""
    lm, req = await _prepare(lab, body)
    job = lab.submit(lm, req, who=who)
    result = await wait_job(request, lab.line, job, who.owner)
    if result is None:
        return {}
    return await anyio.to_thread.run_sync(lambda: lab.view(lm, req, result, body.clean))


@router.delete("/api/patch/jobs/{job_id}", tags=["patch"])
def stop_patch_run(lab: PatchDep, owner: OwnerDep, job_id: str) -> dict:
    """Stop: this browser leaves the run; a running one stops after its current forward."""
    return lab.stop(job_id, owner)
