"""The speculative-decoding lab: /speculative (the page), its htmx forms, and /api/speculative/*.

Runs take seconds of model time: bounded by the lab's limits, one at a time through the model gate
(``app.labs.speculative.SpeculativeLab``). Nothing is kept between requests. A run's defaults are the lab's
(``SpecAsk``): the JSON body and the form read them from there.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from pydantic import BaseModel, Field, field_validator

from app.labs.speculative import DEFAULT_PROMPT, DEFAULTS, SpecAsk
from app.web.deps import SpeculativeDep
from app.web.openapi import Body, errors
from app.web.render import render, request_lang

router = APIRouter()
D = DEFAULTS


class SpecFields(BaseModel):
    model: str | None = None
    prompt: str = Field(DEFAULT_PROMPT, max_length=20_000)  # SpecAsk's default (its field also takes None)
    chat: bool = Field(D.chat, description="the prompt as a user turn in the model's chat template; the output then "
                                            "ends at the template's end-of-turn token")
    go_on: bool = Field(D.go_on, description="decode past the model's end-of-turn / end-of-sequence token (default: "
                                              "both decodings stop there)")
    draft: str = Field(D.draft, description="early (the target's first k blocks), model (a second loaded model) or "
                                            "lookup (prompt lookup: n-gram matching against the context)")
    exit_layer: int | None = Field(D.exit_layer, description="k for the early-exit draft (default: half the blocks)")
    draft_model: str | None = Field(D.draft_model, description="the second model's name (default: the first that fits)")
    max_ngram: int = Field(D.max_ngram, description="prompt lookup: the longest n-gram matched "
                                                    "(1 .. Settings.spec_max_ngram)")
    gamma: int = Field(D.gamma, description="tokens drafted per round (1 .. Settings.spec_max_gamma)")
    max_new_tokens: int = D.max_new_tokens
    mode: str = Field(D.mode, description="greedy or sample")
    temperature: float = D.temperature
    seed: int = Field(D.seed, ge=0, lt=2**31)
    block_size: int = Field(D.block_size, description="tokens per paged block in the block view (1, 2, 4, 8 or 16)")

    def ask(self) -> SpecAsk:
        return SpecAsk(**self.model_dump())


class SpecBody(Body, SpecFields):
    """A run asked for as JSON (strict types)."""


class SpecForm(SpecFields):
    """The page's form: strings made into numbers; an empty field is the default (FastAPI drops empty form values),
    but an emptied prompt is no prompt, and is refused as one."""

    prompt: str | None = Field(None, max_length=20_000)  # type: ignore[assignment]  # the form's field widened

    @field_validator("model", "draft_model", "exit_layer", mode="before")
    @classmethod
    def _empty_is_none(cls, value):
        return None if value == "" else value


class RooflineBody(Body):
    model: str | None = None


def page_context(spec: dict, *, view: dict | None = None) -> dict:
    """What speculative.html reads: the lab's page (``spec``), a run's view to show (a pinned one: /kit), no
    roofline or comparison until asked for."""
    return {"view": view, "roof": None, "cmp": None, "spec": spec}


@router.get("/speculative", include_in_schema=False)
def read_speculative_page(request: Request, lab: SpeculativeDep, model: str | None = None,
                          preset: str | None = None):
    return render(request, "speculative.html", page="speculative", **page_context(lab.page(model, preset)))


@router.post("/speculative/run", include_in_schema=False)
def run_speculative_form(request: Request, lab: SpeculativeDep, form: Annotated[SpecForm, Form()]):
    return render(request, "partials/_speculative_result.html", page="speculative", view=lab.view(form.ask()))


@router.post("/speculative/compare", include_in_schema=False)
def compare_drafts_form(request: Request, lab: SpeculativeDep, form: Annotated[SpecForm, Form()]):
    return render(request, "partials/_speculative_compare.html", page="speculative",
                  cmp=lab.compare(form.ask(), request_lang(request)))


@router.post("/speculative/roofline", include_in_schema=False)
def run_roofline_form(request: Request, lab: SpeculativeDep, model: Annotated[str | None, Form()] = None):
    return render(request, "partials/_roofline_result.html", page="speculative", roof=lab.roofline(model))


@router.post("/api/speculative/run", tags=["speculative"], responses=errors(422, 429, 503))
def run_speculative(lab: SpeculativeDep, body: SpecBody) -> dict:
    """Speculative decoding of the prompt, then plain decoding of the same tokens: every round's drafted tokens with
    p and q, kept / rejected, cache lengths before and after the rollback and the paged blocks it wrote and freed
    (prompt lookup: the n-gram it matched, or that none did); acceptance per position, speed-up."""
    return lab.view(body.ask())


@router.post("/api/speculative/compare", tags=["speculative"], responses=errors(422, 429, 503))
def compare_drafts(request: Request, lab: SpeculativeDep, body: SpecBody) -> dict:
    """The prompt decoded greedily once per draft (prompt lookup, the early exit, a second model when one fits),
    each beside plain decoding timed in the same run: acceptance, mean accepted length, target forwards per token,
    speed-up, and sentences saying which draft wins and why, in the request's language."""
    return lab.compare(body.ask(), request_lang(request))


@router.post("/api/speculative/roofline", tags=["speculative"], responses=errors(422, 429, 503))
def run_roofline(lab: SpeculativeDep, body: RooflineBody) -> dict:
    """This machine's bandwidth (copy, triad) and matmul FLOP/s, and the model's decode steps and a prefill placed
    on that roofline: bytes and FLOPs from the shapes, time measured."""
    return lab.roofline(body.model)

