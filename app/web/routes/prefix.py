"""The prefix-cache lab: page /prefix (htmx form posts) and the JSON API under /api/prefix/."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from pydantic import Field

from app.cache.prefix import (
    DEFAULT_NUM_BLOCKS,
    MAX_NUM_BLOCKS,
    MAX_PROMPTS_PER_RUN,
    finish_lab,
    peek_lab,
    reset_lab,
    run_lab,
)
from app.viz.prefix import lab_view, presets_view
from app.web.deps import OwnerDep, StateDep, is_htmx
from app.web.openapi import Body, errors
from app.web.render import render, request_lang

router = APIRouter()

PROMPT_SEPARATOR = "---"  # a line holding only this separates custom prompts in the form


class RunBody(Body):
    model: str | None = None
    preset: str | None = Field(None, description="system | chat | timestamp, or null/custom to run `prompts`")
    prompts: list[str] | None = Field(None, max_length=MAX_PROMPTS_PER_RUN)
    block_size: str | int = Field("auto", description="auto, 4, 8, 16 or 32 tokens per block")
    capacity: int = Field(DEFAULT_NUM_BLOCKS, ge=1, le=MAX_NUM_BLOCKS, description="cache capacity in blocks")
    salt: str | None = Field(None, max_length=64)


class FinishBody(Body):
    request_id: int | None = Field(None, description="omit to finish every running request")
    reason: str = Field("finished", description="finished | cancelled")


def _split_prompts(text: str | None) -> list[str]:
    if not text:
        return []
    parts, cur = [], []
    for line in text.replace("\r\n", "\n").split("\n"):
        if line.strip() == PROMPT_SEPARATOR:
            parts.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    parts.append("\n".join(cur))
    return [p for p in parts if p.strip()]


def _page(request: Request, state, owner: str, *, form: dict | None = None):
    view = lab_view(peek_lab(state, owner), request_lang(request))
    template = "partials/_prefix_result.html" if is_htmx(request) else "prefix.html"
    presets = presets_view(list(state.registry.models.values()))
    return render(request, template, page="prefix", view=view, presets=presets, form=form or {},
                  separator=PROMPT_SEPARATOR)


# --- page --------------------------------------------------------------------------------------------

@router.get("/prefix", include_in_schema=False)
def read_prefix_page(request: Request, state: StateDep, owner: OwnerDep):
    return _page(request, state, owner)


@router.post("/prefix/run", include_in_schema=False)
def run_prefix_form(
    request: Request, state: StateDep, owner: OwnerDep,
    model: Annotated[str | None, Form()] = None, preset: Annotated[str, Form()] = "system",
    prompts: Annotated[str | None, Form(max_length=20_000)] = None, block_size: Annotated[str, Form()] = "auto",
    capacity: Annotated[int, Form(ge=1, le=MAX_NUM_BLOCKS)] = DEFAULT_NUM_BLOCKS,
    salt: Annotated[str | None, Form(max_length=64)] = None,
):
    run_lab(state, model=model, preset=preset, prompts=_split_prompts(prompts), block_size=block_size,
            num_blocks=capacity, salt=salt, owner=owner)
    return _page(request, state, owner)


@router.post("/prefix/finish", include_in_schema=False)
def finish_prefix_form(request: Request, state: StateDep, owner: OwnerDep,
                       request_id: Annotated[int | None, Form()] = None, reason: Annotated[str, Form()] = "finished"):
    finish_lab(state, request_id=request_id, reason=reason, owner=owner)
    return _page(request, state, owner)


@router.post("/prefix/reset", include_in_schema=False)
def reset_prefix_form(request: Request, state: StateDep, owner: OwnerDep):
    reset_lab(state, owner)
    return _page(request, state, owner)


# --- JSON API ----------------------------------------------------------------------------------------

@router.get("/api/prefix/presets", tags=["prefix"])
def read_prefix_presets(state: StateDep) -> list[dict]:
    """The presets' prompts, with their token counts and auto block size on each model."""
    return presets_view(list(state.registry.models.values()))


@router.get("/api/prefix/state", tags=["prefix"])
def read_prefix_state(request: Request, state: StateDep, owner: OwnerDep) -> dict:
    """This browser's lab as it stands: config, pool counts and blocks, last run's requests, alignment, block rows."""
    return lab_view(peek_lab(state, owner), request_lang(request))


@router.post("/api/prefix/run", tags=["prefix"], responses=errors(410, 422, 429, 503))
def run_prefix(request: Request, body: RunBody, state: StateDep, owner: OwnerDep) -> dict:
    """Finish the previous run, then prefill a preset's prompts (or yours) through the prefix cache."""
    lab = run_lab(state, model=body.model, preset=body.preset, prompts=body.prompts, block_size=body.block_size,
                  num_blocks=body.capacity, salt=body.salt, owner=owner)
    return lab_view(lab, request_lang(request))


@router.post("/api/prefix/finish", tags=["prefix"], responses=errors(404, 410, 422, 503))
def finish_prefix(request: Request, body: FinishBody, state: StateDep, owner: OwnerDep) -> dict:
    """End (or cancel) one running request or all of them: their blocks are released tail first."""
    lab = finish_lab(state, request_id=body.request_id, reason=body.reason, owner=owner)
    return lab_view(lab, request_lang(request))


@router.post("/api/prefix/reset", tags=["prefix"], responses=errors(410, 503))
def reset_prefix(request: Request, state: StateDep, owner: OwnerDep) -> dict:
    """Empty this browser's prefix cache (other browsers' labs are their own)."""
    return lab_view(reset_lab(state, owner), request_lang(request))
