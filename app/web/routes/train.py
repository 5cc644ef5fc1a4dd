"""The Training lab: page /train and its JSON API under /api/train/. Each route calls one lab method.

Runs wait their turn in the lab's line (``app/labs/queue.py``): ``/api/train/jobs`` starts one and follows it
live (the page does; closing the connection stops it), ``/api/train/start`` starts one that is not tied to a
request. The run training now is shown to everyone; only the browser that started a run can stop it.
"""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter, Request

from app.i18n import translator
from app.training.builtin import ARTICLE_CONFIG
from app.viz.labs import train_progress
from app.viz.training import SCRIPT_STRINGS, loss_figure, param_figures
from app.web.cancel import FollowResponse
from app.web.deps import OwnerDep, RequesterDep, TrainingDep
from app.web.labs import follow_job
from app.web.openapi import Body, errors
from app.web.render import render, request_lang

router = APIRouter()

class StartRequest(Body):
    source: str = "builtin"
    text: str | None = None
    steps: int = ARTICLE_CONFIG.steps
    lr: float = ARTICLE_CONFIG.lr
    batch_size: int = ARTICLE_CONFIG.batch_size
    block_size: int = ARTICLE_CONFIG.block_size
    seed: int = ARTICLE_CONFIG.seed
    target: str | None = None  # a finished run is always added as a new model (builtin-trained-N)


class ResumeRequest(Body):
    steps: int | None = None


@router.get("/train", include_in_schema=False)
def read_train_page(request: Request, lab: TrainingDep, owner: OwnerDep):
    lang = request_lang(request)
    page = lab.page(lang, owner)
    init = {"status": page["status"], "figure": loss_figure([tuple(p) for p in page["status"]["losses"]],
                                                            translator(lang))}
    return render(request, "train.html", page="train", init=init, script_keys=SCRIPT_STRINGS, **page)


@router.get("/train/step", include_in_schema=False)
def read_train_step(request: Request, lab: TrainingDep):
    """The training-step panel for the current run (htmx swaps it in when a new run starts)."""
    return render(request, "partials/_train_step.html", page="train", step=lab.step())


@router.get("/train/result", include_in_schema=False)
def read_train_result(request: Request, lab: TrainingDep, owner: OwnerDep):
    """The memory and cached-vs-full panels (htmx swaps them in when a run finishes)."""
    return render(request, "partials/_train_result.html", page="train", **lab.result(request_lang(request), owner))


@router.post("/api/train/jobs", tags=["train"], response_class=FollowResponse, responses=errors(422, 429, 503))
async def follow_training_run(request: Request, lab: TrainingDep, who: RequesterDep,
                              body: StartRequest) -> FollowResponse:
    """Start a run and follow it live: one JSON line per change (``application/x-ndjson``), ``event`` ``queued``
    (``place`` in line, ``eta_s``), ``running`` (``progress``: step, steps, loss), then ``done``, ``stopped``
    (``reason``), ``replaced`` or ``failed``, with ``text`` in the request's language. Closing the connection
    stops the run. Bounds: see the page's form, and ``KVSCOPE_TRAIN_*``."""
    job = await anyio.to_thread.run_sync(
        lambda: lab.submit(lab.spec(**body.model_dump()), who=who, follow=True))
    return follow_job(request, lab.line, job, who.owner, train_progress)


@router.post("/api/train/jobs/resume", tags=["train"], response_class=FollowResponse,
             responses=errors(422, 429, 503))
async def follow_resumed_run(request: Request, lab: TrainingDep, who: RequesterDep,
                             body: ResumeRequest | None = None) -> FollowResponse:
    """Resume the stopped run (it waits its turn again) and follow it live, as ``/api/train/jobs``."""
    # In a worker thread, as a new run's submit is: the line's lock is never waited for on the event loop.
    job = await anyio.to_thread.run_sync(
        lambda: lab.resume(body.steps if body else None, who=who, follow=True))
    return follow_job(request, lab.line, job, who.owner, train_progress)


@router.post("/api/train/start", tags=["train"], responses=errors(422, 429, 503))
def start_training(request: Request, lab: TrainingDep, who: RequesterDep,
                   body: StartRequest) -> dict:
    """Start a run that is not tied to this request: it waits its turn in the line, then trains until it ends,
    is stopped, or reaches ``KVSCOPE_TRAIN_MAX_S``. Bounds: see the page's form."""
    lab.start(lab.spec(**body.model_dump()), who=who)
    return lab.status_view(request_lang(request), who.owner)


@router.post("/api/train/stop", tags=["train"], responses=errors(422))
def stop_training(request: Request, lab: TrainingDep, owner: OwnerDep) -> dict:
    """Stop this browser's run: a waiting one leaves the line, a training one stops after its current step; the
    registered models stay as they were. Another browser's run is not this browser's to stop."""
    lab.stop(owner=owner)
    return lab.status_view(request_lang(request), owner)


@router.post("/api/train/resume", tags=["train"], responses=errors(422, 429, 503))
def resume_training(request: Request, lab: TrainingDep, who: RequesterDep,
                    body: ResumeRequest | None = None) -> dict:
    """Continue the stopped run from its next step, with the same model and AdamW state (it waits its turn)."""
    lab.resume(body.steps if body else None, who=who)
    return lab.status_view(request_lang(request), who.owner)


@router.get("/api/train/status", tags=["train"])
def read_training_status(request: Request, lab: TrainingDep, owner: OwnerDep, since: int = 0) -> dict:
    """The run shown to everyone: status, step, and the losses from step index ``since`` on (for live curves);
    ``line``: how many runs wait, and this browser's own run (its place in line or its progress)."""
    return lab.status_view(request_lang(request), owner, since)


@router.get("/api/train/params", tags=["train"])
def read_parameter_names(lab: TrainingDep) -> list[dict]:
    return lab.parameters()


@router.get("/api/train/param", tags=["train"], responses=errors(422))
def read_parameter(
    request: Request, lab: TrainingDep, name: str | None = None, part: str | None = "q", lang: str | None = None
) -> dict:
    """One parameter's value, grad, exp_avg, exp_avg_sq and AdamW step, with a heatmap spec for each (``name``
    left out: the parameter the page opens on, layer 0's query projection; ``part`` q, k, v or all slices a fused
    q/k/v projection).

    Axis titles are in ``lang`` (else the language cookie, else English)."""
    return param_figures(lab.parameter(name, part), translator(request_lang(request)))


@router.get("/api/train/step", tags=["train"])
def read_training_step(lab: TrainingDep) -> dict:
    return lab.step()


@router.get("/api/train/memory", tags=["train"])
def read_training_memory(lab: TrainingDep) -> dict:
    return lab.memory()
