"""The decode studio's operations: what the routes call, one function each.

Every action on a session holds that session's lock (``SessionStore.hold``): its limits are checked and its
forward runs under it, so concurrent clicks take turns. Forwards go through the model gate; a step is short
work (served before queued captures), a prefill or a check is long work.
"""

from __future__ import annotations

from app.errors import BadInput, Expired
from app.model.decode import DecodeSession, Step
from app.model.prompts import encode_prompt
from app.model.sampling import Sampling
from app.state import AppState


def start_session(state: AppState, *, model: str | None, prompt: str | None, sampling: Sampling,
                  owner: str = "", chat: bool = False) -> DecodeSession:
    lm = state.model(model)
    st = state.settings
    # A long prompt decodes too (the step's attention row then spans thousands of cached positions): the long
    # prompts' limits (characters, then ``max_context_tokens``); its cache's bytes are checked against the
    # sessions' budget before the prefill runs (``SessionStore.room``).
    ids = encode_prompt(lm, prompt, max_chars=max(st.max_prompt_chars, st.long_max_chars), reserve=1, chat=chat)
    if len(ids) > st.max_context_tokens:
        raise BadInput("err.long.tokens", n=f"{len(ids):,}", model=lm.name, limit=f"{st.max_context_tokens:,}")
    return _prefilled(state, lm, ids, sampling.validate(), owner)


def rebuild_session(state: AppState, old_id: str, owner: str = "") -> DecodeSession:
    """A new session whose prompt is every token of an ended one: one prefill rebuilds its cache."""
    stone = state.sessions.tombstone(old_id, owner)
    if stone is None:
        raise Expired("err.session.forgotten")
    lm = state.model(stone["model"])
    if stone["model_ref"]() is not lm:
        raise Expired("sturdy.model_changed", model=stone["model"])
    ids = stone["ids"][: lm.max_positions - 1]
    return _prefilled(state, lm, ids, Sampling(**stone["sampling"]), owner)


def _prefilled(state: AppState, lm, ids: list[int], sampling: Sampling, owner: str) -> DecodeSession:
    session = state.sessions.create(lm, ids, sampling, owner=owner)
    try:
        with state.sessions.hold(session.id, owner), state.sessions.room(session, len(ids)), state.model_lock:
            session.prefill()
    except Exception:
        state.sessions.delete(session.id, owner)  # a refused or failed prefill leaves nothing behind
        raise
    return session


def step_session(state: AppState, sid: str, owner: str = "") -> tuple[DecodeSession, Step]:
    with state.sessions.hold(sid, owner) as session:
        if session.done:
            raise BadInput("err.session.limit", steps=session.max_steps, positions=session.lm.max_positions)
        with state.sessions.room(session, 1), state.model_lock.short():
            step = session.step()
    return session, step


def verify_step(state: AppState, sid: str, index: int, owner: str = "") -> dict:
    """Not under the session lock: a check only reads steps already taken (the list only grows), so the
    next step need not wait for it. A session released meanwhile has no steps left: 410."""
    session = state.sessions.get(sid, owner)
    if not 0 <= index < len(session.steps):
        raise BadInput("err.session.step_range", index=index, last=len(session.steps) - 1)
    with state.model_lock:
        try:
            return session.verify(index)
        except IndexError:
            raise Expired("err.session.ended") from None
