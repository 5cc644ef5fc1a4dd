"""The speculative-decoding lab: /speculative (the page), its two htmx forms, and /api/speculative/*.

Runs take seconds of model time: bounded by ``Settings.spec_*`` and ``Settings.roofline_*``, one at a time through
the model gate (``app.labs.speculative``). Nothing is kept between requests.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from pydantic import Field

from app.labs.speculative import BLOCK_SIZES, default_exit_layer, draft_models, roofline_request, run_request
from app.viz.roofline import roofline_view
from app.viz.speculative import spec_view
from app.web.deps import StateDep
from app.web.openapi import Body, errors
from app.web.render import render

router = APIRouter()

DEFAULT_PROMPT = "The KV cache stores the keys and values of"


class SpecBody(Body):
    model: str | None = None
    prompt: str = Field(DEFAULT_PROMPT, max_length=20_000)
    draft: str = Field("early", description="early (the target's first k blocks) or model (a second loaded model)")
    exit_layer: int | None = Field(None, description="k for the early-exit draft (default: half the blocks)")
    draft_model: str | None = Field(None, description="the second model's name (default: the first that fits)")
    gamma: int = Field(4, description="tokens drafted per round (1 .. Settings.spec_max_gamma)")
    max_new_tokens: int = 24
    mode: str = Field("greedy", description="greedy or sample")
    temperature: float = 1.0
    seed: int = Field(0, ge=0, lt=2**31)
    block_size: int = Field(4, description="tokens per paged block in the block view (1, 2, 4, 8 or 16)")


class RooflineBody(Body):
    model: str | None = None


def _form(state, model: str | None, **values) -> dict:
    lm = state.model(model)
    form = {"model": lm.name, "prompt": DEFAULT_PROMPT, "draft": "early", "exit_layer": default_exit_layer(lm),
            "draft_model": None, "gamma": 4, "max_new_tokens": 24, "mode": "greedy", "temperature": 1.0, "seed": 0,
            "block_size": 4}
    form.update({k: v for k, v in values.items() if v is not None})
    return {"form": form, "n_layer": lm.adapter.n_layer, "candidates": draft_models(state, lm),
            "limits": state.settings, "block_sizes": BLOCK_SIZES}


@router.get("/speculative", include_in_schema=False)
def read_speculative_page(request: Request, state: StateDep, model: str | None = None):
    return render(request, "speculative.html", page="speculative", view=None, roof=None, **_form(state, model))


@router.post("/speculative/run", include_in_schema=False)
def run_speculative_form(
    request: Request, state: StateDep, model: Annotated[str | None, Form()] = None,
    prompt: Annotated[str | None, Form(max_length=20_000)] = None, draft: Annotated[str, Form()] = "early",
    exit_layer: Annotated[int | None, Form()] = None, draft_model: Annotated[str | None, Form()] = None,
    gamma: Annotated[int, Form()] = 4, max_new_tokens: Annotated[int, Form()] = 24,
    mode: Annotated[str, Form()] = "greedy", temperature: Annotated[float, Form()] = 1.0,
    seed: Annotated[int, Form(ge=0, lt=2**31)] = 0, block_size: Annotated[int, Form()] = 4,
):
    run = run_request(state, model=model, prompt=prompt, draft=draft, exit_layer=exit_layer,
                      draft_model=draft_model or None, gamma=gamma, max_new_tokens=max_new_tokens, mode=mode,
                      temperature=temperature, seed=seed, block_size=block_size)
    return render(request, "partials/_speculative_result.html", page="speculative", view=spec_view(run))


@router.post("/speculative/roofline", include_in_schema=False)
def run_roofline_form(request: Request, state: StateDep, model: Annotated[str | None, Form()] = None):
    return render(request, "partials/_roofline_result.html", page="speculative",
                  roof=roofline_view(roofline_request(state, model=model)))


@router.post("/api/speculative/run", tags=["speculative"], responses=errors(422, 429, 503))
def run_speculative(state: StateDep, body: SpecBody) -> dict:
    """Speculative decoding of the prompt, then plain decoding of the same tokens: every round's drafted tokens with
    p and q, kept / rejected, cache lengths before and after the rollback and the paged blocks it wrote and freed;
    acceptance per position, speed-up."""
    run = run_request(state, model=body.model, prompt=body.prompt, draft=body.draft, exit_layer=body.exit_layer,
                      draft_model=body.draft_model, gamma=body.gamma, max_new_tokens=body.max_new_tokens,
                      mode=body.mode, temperature=body.temperature, seed=body.seed, block_size=body.block_size)
    return spec_view(run)


@router.post("/api/speculative/roofline", tags=["speculative"], responses=errors(422, 429, 503))
def run_roofline(state: StateDep, body: RooflineBody) -> dict:
    """This machine's bandwidth (copy, triad) and matmul FLOP/s, and the model's decode steps and a prefill placed
    on that roofline: bytes and FLOPs from the shapes, time measured."""
    return roofline_view(roofline_request(state, model=body.model))
