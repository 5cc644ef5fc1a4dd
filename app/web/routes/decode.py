"""The decode studio: page and JSON API."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import Field

from app.model.sampling import Sampling
from app.model.studio import rebuild_session, start_session, step_session, verify_step
from app.viz.decode import cache_rows, step_view
from app.viz.tokens import unknown_note
from app.web.deps import OwnerDep, SessionsDep, StateDep
from app.web.openapi import Body, errors
from app.web.render import render

router = APIRouter()


class StartBody(Body):
    prompt: str = Field(max_length=100_000)
    model: str | None = None
    mode: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False  # the prompt as a user turn in the model's chat template


@router.get("/decode", include_in_schema=False)
def read_decode_page(request: Request, state: StateDep, prompt: str = "The cat sat on", model: str | None = None,
                     chat: bool = False):
    lm = state.model(model)
    return render(request, "decode.html", page="decode", prompt=prompt, model_name=lm.name,
                  chat_template=lm.has_chat_template, chat=chat)


@router.post("/api/decode/sessions", tags=["decode"], responses=errors(422, 429, 503))
def create_session(state: StateDep, owner: OwnerDep, body: StartBody) -> dict:
    """Start a session: prefill the prompt, fill the KV cache, choose the first token."""
    sampling = Sampling(mode=body.mode, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                        seed=body.seed)
    session = start_session(state, model=body.model, prompt=body.prompt, sampling=sampling, owner=owner,
                            chat=body.chat)
    view = step_view(session, session.steps[-1])
    view["unknown"] = unknown_note(session.lm, session.prompt_ids, body.prompt)
    return view


@router.post("/api/decode/{sid}/step", tags=["decode"], responses=errors(410, 422, 429, 503))
def create_step(state: StateDep, owner: OwnerDep, sid: str) -> dict:
    """Feed the last chosen token (input (1, 1)) through every layer with the cache."""
    with state.sessions.hold(sid, owner):  # the view is read before another click can change the session
        session, step = step_session(state, sid, owner)
        return step_view(session, step)


@router.get("/api/decode/{sid}/verify/{index}", tags=["decode"], responses=errors(410, 422, 429, 503))
def read_verify(state: StateDep, owner: OwnerDep, sid: str, index: int) -> dict:
    """Recompute step ``index`` from the full prefix with no cache and compare."""
    return verify_step(state, sid, index, owner)


@router.get("/api/decode/{sid}/cache/{layer}/{head}", tags=["decode"], responses=errors(410, 422))
def read_cache_rows(sessions: SessionsDep, owner: OwnerDep, sid: str, layer: int, head: int, last: int = 24) -> dict:
    with sessions.hold(sid, owner) as session:
        return cache_rows(session, layer, head, max(1, min(last, 256)))


@router.delete("/api/decode/{sid}", tags=["decode"])
def delete_session(sessions: SessionsDep, owner: OwnerDep, sid: str) -> dict:
    """Stop and release the session's KV cache."""
    return {"released": sessions.delete(sid, owner)}


@router.post("/api/decode/{sid}/close", tags=["decode"])
def close_session(sessions: SessionsDep, owner: OwnerDep, sid: str) -> dict:
    """The same as DELETE, for navigator.sendBeacon when a tab closes."""
    return {"released": sessions.delete(sid, owner)}


@router.post("/api/decode/{sid}/rebuild", tags=["decode"], responses=errors(410, 422, 429, 503))
def create_rebuilt(state: StateDep, owner: OwnerDep, sid: str) -> dict:
    """Start a new session from an ended one's tokens."""
    session = rebuild_session(state, sid, owner)
    return step_view(session, session.steps[-1])


@router.get("/api/decode/stats", tags=["decode"])
def read_stats(sessions: SessionsDep, owner: OwnerDep) -> dict:
    """Sessions on the whole server (shared by every browser) and how many are this browser's."""
    return {**sessions.stats(), "mine": sessions.owned_by(owner)}
