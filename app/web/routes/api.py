"""JSON API (documented at /docs)."""

from __future__ import annotations

from fastapi import APIRouter

from app.viz.models import model_card
from app.web.deps import InspectDep, RequesterDep, StateDep
from app.web.openapi import errors
from app.web.render import MatrixJSON

router = APIRouter()


@router.get("/healthz", tags=["meta"])
async def read_health(state: StateDep) -> dict:
    """Answered on the event loop, never in the worker threads that wait for the model: fast under any load."""
    reg = state.registry
    return {"status": "ok", "models": reg.names, "default": reg.default, "unavailable": reg.failures,
            "queue": state.model_lock.stats(),
            "labs": {"arena": state.arena.line.stats(), "train": state.training.line.stats()}}


@router.get("/api/models", tags=["meta"])
def read_models(state: StateDep) -> list[dict]:
    return [model_card(lm) for lm in state.registry.models.values()]


@router.get("/api/trace", tags=["inspect"], responses=errors(422, 429, 503))
def read_trace(lab: InspectDep, who: RequesterDep, prompt: str, model: str | None = None, chat: bool = False) -> dict:
    """Tokenize and run a prompt (``chat``: as a user turn in the model's chat template); returns its trace key,
    tokens, shape trace and next-token top-k."""
    return lab.trace_view(model=model, prompt=prompt, chat=chat, who=who)


@router.get("/api/traces/{key}/grid", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_grid(lab: InspectDep, who: RequesterDep, key: str, size: int = 48) -> dict:
    """Every layer × head as a small uint8 image (max-pooled), ``size`` pixels a side (4 to
    ``KVSCOPE_INSPECT_MAX_GRID_SIZE``), for the all-heads grid."""
    return lab.grid(key, size, who=who)


@router.get("/api/traces/{key}/attention/{layer}/{head}", tags=["inspect"], response_class=MatrixJSON,
            responses=errors(410, 422, 429, 503))
def read_attention(lab: InspectDep, who: RequesterDep, key: str, layer: int, head: int, kind: str = "weights",
                   encoding: str = "f32") -> MatrixJSON:
    """One head's matrix (weights, masked or raw scores) as base64 float32 (``encoding=f32``), or weights as one
    byte a cell for drawing (``encoding=sqrt-u8``: round(255·√w), decoded (b / 255)²)."""
    return MatrixJSON(lab.attention(key, layer, head, kind, encoding, who=who))


@router.get("/api/traces/{key}/arithmetic/{layer}/{head}/{q}", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_arithmetic(lab: InspectDep, who: RequesterDep, key: str, layer: int, head: int, q: int) -> dict:
    """Q·K / √d, softmax and the weighted sum of V for one query, next to the model's own numbers."""
    return lab.arithmetic(key, layer, head, q, who=who)


@router.get("/api/traces/{key}/why/{layer}/{head}", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_why(lab: InspectDep, who: RequesterDep, key: str, layer: int, head: int, q: int, k: int | None = None) -> dict:
    """Query ``q``'s score on key ``k`` (default: the key it attends to most) split by rotary frequency pair (or by
    dimension for a position table), with the score before rotation ("content") and the difference ("position")."""
    return lab.why(key, layer, head, q, k, who=who)


@router.get("/api/traces/{key}/embedding/{pos}", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_embedding(lab: InspectDep, who: RequesterDep, key: str, pos: int) -> dict:
    """The full wte row, wpe row and h0 of one token."""
    return lab.embedding(key, pos, who=who)
