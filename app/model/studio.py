"""The decode studio's operations: what the routes call, one function each, under the model lock."""

from __future__ import annotations

from app.errors import BadInput, Expired
from app.model.decode import DecodeSession, Step
from app.model.prompts import encode_prompt
from app.model.sampling import Sampling
from app.state import AppState


def start_session(state: AppState, *, model: str | None, prompt: str | None, sampling: Sampling) -> DecodeSession:
    lm = state.model(model)
    ids = encode_prompt(lm, prompt, max_chars=state.settings.max_prompt_chars, reserve=1)
    session = state.sessions.create(lm, ids, sampling.validate())
    with state.model_lock:
        session.prefill()
    return session


def rebuild_session(state: AppState, old_id: str) -> DecodeSession:
    """A new session whose prompt is every token of an ended one: one prefill rebuilds its cache."""
    stone = state.sessions.tombstone(old_id)
    if stone is None:
        raise Expired("err.session.forgotten")
    lm = state.model(stone["model"])
    ids = stone["ids"][: lm.max_positions - 1]
    session = state.sessions.create(lm, ids, Sampling(**stone["sampling"]))
    with state.model_lock:
        session.prefill()
    return session


def step_session(state: AppState, sid: str) -> tuple[DecodeSession, Step]:
    session = state.sessions.get(sid)
    if session.done:
        raise BadInput("err.session.limit", steps=session.max_steps, positions=session.lm.max_positions)
    state.sessions.check_budget(session)
    with state.model_lock:
        step = session.step()
    return session, step


def verify_step(state: AppState, sid: str, index: int) -> dict:
    session = state.sessions.get(sid)
    if not 0 <= index < len(session.steps):
        raise BadInput("err.session.step_range", index=index, last=len(session.steps) - 1)
    with state.model_lock:
        return session.verify(index)
