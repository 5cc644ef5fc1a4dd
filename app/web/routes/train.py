"""The Training lab: page /train and its JSON API under /api/train/. Each route calls one lab method."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.i18n import translate, translator
from app.model.builtin import ARTICLE_CONFIG, article_corpus_text
from app.training.jobs import LIMITS, MAX_TEXT_CHARS, MIN_TEXT_CHARS, lab_for, make_spec
from app.viz.training import ARTICLE_MAX_DIFF, SCRIPT_STRINGS, loss_figure, param_figures
from app.web.deps import StateDep
from app.web.openapi import Body, errors
from app.web.render import render, request_lang

router = APIRouter()

DEFAULT_PARAM = "transformer.h.0.attn.c_attn.weight"


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


def said(status: dict, lang: str) -> dict:
    """The status with its failure (a catalog key, ``app.training.jobs.failure_key``) as a sentence in ``lang``."""
    if status.get("error"):
        status["error"] = translate(status["error"], lang)
    return status


@router.get("/train", include_in_schema=False)
def read_train_page(request: Request, state: StateDep):
    lab = lab_for(state)
    status = said(lab.status(), request_lang(request))
    _ = translator(request_lang(request))
    init = {"status": status, "figure": loss_figure([tuple(p) for p in status["losses"]], _),
            "default_param": DEFAULT_PARAM}
    return render(
        request, "train.html", page="train", status=status, init=init, script_keys=SCRIPT_STRINGS,
        parameters=lab.parameters(), default_param=DEFAULT_PARAM, step=lab.step(), memory=lab.memory(),
        defaults=ARTICLE_CONFIG, limits=LIMITS, corpus_chars=len(article_corpus_text()),
        min_chars=MIN_TEXT_CHARS, max_chars=MAX_TEXT_CHARS, article_max_diff=ARTICLE_MAX_DIFF,
    )


@router.get("/train/step", include_in_schema=False)
def read_train_step(request: Request, state: StateDep):
    """The training-step panel for the current run (htmx swaps it in when a new run starts)."""
    return render(request, "partials/_train_step.html", page="train", step=lab_for(state).step())


@router.get("/train/result", include_in_schema=False)
def read_train_result(request: Request, state: StateDep):
    """The memory and cached-vs-full panels (htmx swaps them in when a run finishes)."""
    lab = lab_for(state)
    return render(request, "partials/_train_result.html", page="train", status=lab.status(), memory=lab.memory(),
                  article_max_diff=ARTICLE_MAX_DIFF)


@router.post("/api/train/start", tags=["train"], responses=errors(422, 503))
def start_training(state: StateDep, body: StartRequest) -> dict:
    """Start a run (503 while another one is running). Bounds: see the page's form."""
    return lab_for(state).start(make_spec(**body.model_dump()))


@router.post("/api/train/stop", tags=["train"], responses=errors(422))
def stop_training(state: StateDep) -> dict:
    """Ask the running job to stop after its current step; the registered models stay as they were."""
    return lab_for(state).stop()


@router.post("/api/train/resume", tags=["train"], responses=errors(422, 503))
def resume_training(state: StateDep, body: ResumeRequest | None = None) -> dict:
    """Continue the stopped run from its next step, with the same model and AdamW state."""
    return lab_for(state).resume(body.steps if body else None)


@router.get("/api/train/status", tags=["train"])
def read_training_status(request: Request, state: StateDep, since: int = 0) -> dict:
    """The current job: status, step, and the losses from step index ``since`` on (for live curves)."""
    return said(lab_for(state).status(since), request_lang(request))


@router.get("/api/train/params", tags=["train"])
def read_parameter_names(state: StateDep) -> list[dict]:
    return lab_for(state).parameters()


@router.get("/api/train/param", tags=["train"], responses=errors(422))
def read_parameter(
    request: Request, state: StateDep, name: str = DEFAULT_PARAM, part: str | None = "q", lang: str | None = None
) -> dict:
    """One parameter's value, grad, exp_avg, exp_avg_sq and AdamW step, with a heatmap spec for each.

    Axis titles are in ``lang`` (else the language cookie, else English)."""
    return param_figures(lab_for(state).parameter(name, part), translator(request_lang(request)))


@router.get("/api/train/step", tags=["train"])
def read_training_step(state: StateDep) -> dict:
    return lab_for(state).step()


@router.get("/api/train/memory", tags=["train"])
def read_training_memory(state: StateDep) -> dict:
    return lab_for(state).memory()
