"""The prefix-cache lab: page /prefix (htmx form posts) and the JSON API under /api/prefix/. Each route parses, calls
one method of ``app/labs/prefix.py``, renders."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from pydantic import Field

from app.labs.prefix import split_prompts
from app.web.deps import OwnerDep, PrefixDep, RequesterDep, is_htmx
from app.web.openapi import Body, errors
from app.web.render import render, request_lang

router = APIRouter()


class RunBody(Body):
    model: str | None = None
    preset: str | None = Field(None, description="system | chat | timestamp, or null/custom to run `prompts`")
    prompts: list[str] | None = Field(None, description="at most KVSCOPE_PREFIX_MAX_PROMPTS")
    block_size: str | int = Field("auto", description="auto, 4, 8, 16 or 32 tokens per block")
    capacity: int | None = Field(None, description="cache capacity in blocks, 1 to KVSCOPE_PREFIX_MAX_BLOCKS "
                                                   "(omit: KVSCOPE_PREFIX_DEFAULT_BLOCKS, grown to fit the run)")
    salt: str | None = Field(None, description="at most KVSCOPE_PREFIX_MAX_SALT_CHARS characters")


class FinishBody(Body):
    request_id: int | None = Field(None, description="omit to finish every running request")
    reason: str = Field("finished", description="finished | cancelled")


def _page(request: Request, lab, owner: str):
    template = "partials/_prefix_result.html" if is_htmx(request) else "prefix.html"
    return render(request, template, page="prefix", **lab.page(owner, request_lang(request)))


# --- page --------------------------------------------------------------------------------------------

@router.get("/prefix", include_in_schema=False)
def read_prefix_page(request: Request, lab: PrefixDep, owner: OwnerDep):
    return _page(request, lab, owner)


@router.post("/prefix/run", include_in_schema=False)
def run_prefix_form(
    request: Request, lab: PrefixDep, who: RequesterDep,
    model: Annotated[str | None, Form()] = None, preset: Annotated[str, Form()] = "system",
    prompts: Annotated[str | None, Form()] = None, block_size: Annotated[str, Form()] = "auto",
    capacity: Annotated[int | None, Form()] = None, salt: Annotated[str | None, Form()] = None,
):
    lab.run(model=model, preset=preset, prompts=split_prompts(prompts), block_size=block_size, num_blocks=capacity,
            salt=salt, who=who)
    return _page(request, lab, who.owner)


@router.post("/prefix/finish", include_in_schema=False)
def finish_prefix_form(request: Request, lab: PrefixDep, who: RequesterDep,
                       request_id: Annotated[int | None, Form()] = None, reason: Annotated[str, Form()] = "finished"):
    lab.finish(request_id=request_id, reason=reason, who=who)
    return _page(request, lab, who.owner)


@router.post("/prefix/reset", include_in_schema=False)
def reset_prefix_form(request: Request, lab: PrefixDep, who: RequesterDep):
    lab.reset(who)
    return _page(request, lab, who.owner)


# --- JSON API ----------------------------------------------------------------------------------------

@router.get("/api/prefix/presets", tags=["prefix"])
def read_prefix_presets(lab: PrefixDep) -> list[dict]:
    """The presets' prompts, with their token counts and auto block size on each model."""
    return lab.presets()


@router.get("/api/prefix/state", tags=["prefix"])
def read_prefix_state(request: Request, lab: PrefixDep, owner: OwnerDep) -> dict:
    """This browser's lab as it stands: config, pool counts and blocks, last run's requests, alignment, block rows."""
    return lab.view(owner, request_lang(request))


@router.post("/api/prefix/run", tags=["prefix"], responses=errors(410, 422, 429, 503))
def run_prefix(request: Request, body: RunBody, lab: PrefixDep, who: RequesterDep) -> dict:
    """Finish the previous run, then prefill a preset's prompts (or yours) through the prefix cache."""
    lab.run(model=body.model, preset=body.preset, prompts=body.prompts, block_size=body.block_size,
            num_blocks=body.capacity, salt=body.salt, who=who)
    return lab.view(who.owner, request_lang(request))


@router.post("/api/prefix/finish", tags=["prefix"], responses=errors(404, 410, 422, 429, 503))
def finish_prefix(request: Request, body: FinishBody, lab: PrefixDep, who: RequesterDep) -> dict:
    """End (or cancel) one running request or all of them: their blocks are released tail first."""
    lab.finish(request_id=body.request_id, reason=body.reason, who=who)
    return lab.view(who.owner, request_lang(request))


@router.post("/api/prefix/reset", tags=["prefix"], responses=errors(410, 429, 503))
def reset_prefix(request: Request, lab: PrefixDep, who: RequesterDep) -> dict:
    """Empty this browser's prefix cache (other browsers' labs are their own)."""
    lab.reset(who)
    return lab.view(who.owner, request_lang(request))
