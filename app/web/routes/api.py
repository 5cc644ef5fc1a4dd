"""JSON API (documented at /docs)."""

from __future__ import annotations

from fastapi import APIRouter, Query

from app.viz.attention import arithmetic, embedding_rows, grid_thumbnails, head_matrix
from app.viz.inspect import inspect_view
from app.viz.models import model_card
from app.web.deps import StateDep
from app.web.openapi import errors
from app.web.render import MatrixJSON

router = APIRouter()


@router.get("/healthz", tags=["meta"])
async def read_health(state: StateDep) -> dict:
    """Answered on the event loop, never in the worker threads that wait for the model: fast under any load."""
    reg = state.registry
    return {"status": "ok", "models": reg.names, "default": reg.default, "unavailable": reg.failures,
            "queue": state.model_lock.stats(),
            "labs": {"arena": state.arena_lab.stats(), "train": state.training.line.stats()}}


@router.get("/api/models", tags=["meta"])
def read_models(state: StateDep) -> list[dict]:
    return [model_card(lm) for lm in state.registry.models.values()]


@router.get("/api/trace", tags=["inspect"], responses=errors(422, 429, 503))
def read_trace(state: StateDep, prompt: str, model: str | None = None, chat: bool = False) -> dict:
    """Tokenize and run a prompt (``chat``: as a user turn in the model's chat template); returns its trace key,
    tokens, shape trace and next-token top-k."""
    lm, key, trace = state.trace_prompt(model, prompt, chat=chat)
    return inspect_view(lm, key, trace, prompt=prompt)


@router.get("/api/traces/{key}/grid", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_grid(state: StateDep, key: str, size: int = Query(48, ge=4, le=128)) -> dict:
    """Every layer × head as a small uint8 image (max-pooled), for the all-heads grid."""
    _, trace = state.trace_by_key(key)
    return grid_thumbnails(trace, size=size)


@router.get("/api/traces/{key}/attention/{layer}/{head}", tags=["inspect"], response_class=MatrixJSON,
            responses=errors(410, 422, 429, 503))
def read_attention(state: StateDep, key: str, layer: int, head: int, kind: str = "weights") -> MatrixJSON:
    """One head's matrix (weights, masked or raw scores) as base64 float32."""
    _, trace = state.trace_by_key(key)
    return MatrixJSON(head_matrix(trace, layer, head, kind))


@router.get("/api/traces/{key}/arithmetic/{layer}/{head}/{q}", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_arithmetic(state: StateDep, key: str, layer: int, head: int, q: int) -> dict:
    """Q·K / √d, softmax and the weighted sum of V for one query, next to the model's own numbers."""
    _, trace = state.trace_by_key(key)
    return arithmetic(trace, layer, head, q, limit=trace.n_tokens)


@router.get("/api/traces/{key}/embedding/{pos}", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_embedding(state: StateDep, key: str, pos: int) -> dict:
    """The full wte row, wpe row and h0 of one token."""
    _, trace = state.trace_by_key(key)
    return embedding_rows(trace, pos, first=None)
