"""The compression arena: /arena (the page; with a query, the run as a fragment or a full page) and /api/arena/run.

Runs take seconds of model time: they are bounded by ``Settings.arena_*``, one at a time, with the model
lock taken per policy (``app.cache.arena``).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from pydantic import Field

from app.cache.arena import run_request
from app.cache.policies import POLICIES, available
from app.viz.arena import arena_view
from app.web.deps import StateDep, is_htmx
from app.web.openapi import Body, errors
from app.web.render import render

router = APIRouter()

DEFAULT_POLICIES = ("window", "streaming", "streaming-norerope", "h2o", "snapkv", "kivi", "int8-head", "int4-head")


class ArenaRun(Body):
    model: str | None = None
    source: Literal["text", "prompt"] = "text"
    prompt: str | None = Field(None, max_length=20_000)
    steps: int = 16
    budget_kind: Literal["percent", "bytes"] = "percent"
    budget: float = 25.0
    policies: list[str] = Field(default_factory=lambda: list(DEFAULT_POLICIES))


def _run(state, body: ArenaRun) -> tuple[object, dict]:
    lm = state.model(body.model)
    s = state.settings
    run = run_request(lm, lock=state.model_lock, source=body.source, prompt=body.prompt, steps=body.steps,
                      budget_kind=body.budget_kind, budget_value=body.budget, policies=body.policies,
                      max_prompt_tokens=s.arena_max_prompt_tokens, max_steps=s.arena_max_steps,
                      max_chars=s.max_prompt_chars)
    return lm, arena_view(lm, run)


@router.get("/arena", include_in_schema=False)
def read_arena(
    request: Request, state: StateDep, model: str | None = None, source: Literal["text", "prompt"] | None = None,
    prompt: str | None = None, steps: int = 16, budget_kind: Literal["percent", "bytes"] = "percent",
    budget: float = 25.0, policies: list[str] = Query(default=list(DEFAULT_POLICIES)),
):
    lm = state.model(model)
    form = ArenaRun(model=model, source=source or "text", prompt=prompt, steps=steps, budget_kind=budget_kind,
                    budget=budget, policies=policies)
    view = None
    if source is not None:
        lm, view = _run(state, form)
    fragment = is_htmx(request) and view is not None
    template = "partials/_arena_result.html" if fragment else "arena.html"
    return render(request, template, page="arena", view=view, form=form, all_policies=POLICIES,
                  applicable=available(lm.adapter), limits=state.settings, oob=fragment)


@router.post("/api/arena/run", tags=["arena"], responses=errors(422, 429, 503))
def run_arena_api(state: StateDep, body: ArenaRun) -> dict:
    """Every chosen policy against full attention on one prompt: per-step KL, agreement, perplexity, attention mass,
    kept maps, bytes held, first divergence (the page's numbers)."""
    return _run(state, body)[1]
