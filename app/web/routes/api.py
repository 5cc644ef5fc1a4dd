"""JSON API (documented at /docs)."""

from __future__ import annotations

from fastapi import APIRouter

from app.viz.inspect import inspect_view
from app.viz.models import model_card
from app.web.deps import StateDep

router = APIRouter()


@router.get("/healthz", tags=["meta"])
def read_health(state: StateDep) -> dict:
    reg = state.registry
    return {"status": "ok", "models": reg.names, "default": reg.default, "unavailable": reg.failures}


@router.get("/api/models", tags=["meta"])
def read_models(state: StateDep) -> list[dict]:
    return [model_card(lm) for lm in state.registry.models.values()]


@router.get("/api/trace", tags=["inspect"])
def read_trace(state: StateDep, prompt: str, model: str | None = None) -> dict:
    """Tokenize and run a prompt; returns its trace key, tokens, shape trace and next-token top-k."""
    lm, key, trace = state.trace_prompt(model, prompt)
    return inspect_view(lm, key, trace)
