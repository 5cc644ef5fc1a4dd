"""The decode studio (/decode): what its routes call, one method each.

``DecodeLab`` owns the studio's pieces, handed in by ``app/state.py``: the served models, the decode sessions
(``SessionStore``: owner, caps, byte budget, each session's lock), the model gate and the settings. Every action
on a session holds that session's lock (``SessionStore.hold``): its limits are checked, its forward runs and
its view is read under it, so concurrent clicks take turns. Forwards go through the model gate; a step is short
work (served before queued captures), a prefill or a check is long work.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.admission import ModelGate
from app.errors import BadInput, Expired
from app.labs.limits import Limits
from app.labs.long import long_text
from app.model.decode import DecodeSession, Step
from app.model.loading import LoadedModel, ModelRegistry
from app.model.prompts import encode_prompt
from app.model.sampling import Sampling
from app.model.sessions import SessionStore
from app.model.timing import time_step_vs_recompute
from app.quota import NOBODY, Requester
from app.viz.cache_saving import saving_view
from app.viz.decode import attention_cell, attention_view, cache_rows, step_view
from app.viz.tokens import unknown_note


@dataclass(frozen=True)
class DecodeLimits(Limits):
    """The sessions' caps (shown on the page; the store enforces them), the prompt's characters and tokens (a
    long prompt decodes too) and the cache rows one request reads."""

    GROUP = "decode"
    session_ttl_s: float
    max_sessions: int
    max_sessions_per_browser: int
    session_cache_bytes: int
    max_decode_steps: int
    decode_max_cache_rows: int
    decode_max_row_width: int
    decode_timing_repeats: int
    decode_timing_tokens: int
    max_prompt_chars: int
    long_max_chars: int
    max_context_tokens: int


class DecodeLab:
    def __init__(self, *, registry: ModelRegistry, sessions: SessionStore, gate: ModelGate,
                 limits: DecodeLimits) -> None:
        self.registry = registry
        self.sessions = sessions
        self.gate = gate
        self.limits = limits

    # --- what the routes call: plain data out -----------------------------------------------------------
    def page(self, *, model: str | None, prompt: str, chat: bool) -> dict:
        """The page's context: the prompt, the model and whether it has a chat template."""
        lm = self.registry.pick(model)
        return {"prompt": prompt, "model_name": lm.name, "chat_template": lm.has_chat_template, "chat": chat,
                "end_token": lm.end_text(), "limits": self.limits}

    def start(self, *, model: str | None, prompt: str | None, sampling: Sampling, who: Requester = NOBODY,
              chat: bool = False, layer: int = 0, width: int = 900) -> dict:
        """A new session: the prompt prefilled, the first token chosen; its view (the attention of ``layer``
        pooled to ``width`` columns: the page's plot), with the prompt's unknown characters named."""
        self._check_layer(self.registry.pick(model), layer)
        session = self.start_session(model=model, prompt=prompt, sampling=sampling, who=who, chat=chat)
        view = step_view(session, session.steps[-1], layer=layer, width=self._width(width))
        view["unknown"] = unknown_note(session.lm, session.prompt_ids, prompt or "")
        return view

    def step(self, sid: str, owner: str = "", *, layer: int = 0, width: int = 900, go_on: bool = False) -> dict:
        """One step with the cache; its view is read before another click can change the session. At the model's
        end token the session stops unless ``go_on`` (the learner's "go on past the end token")."""
        with self.sessions.hold(sid, owner) as held:
            self._check_layer(held.lm, layer)  # before the step: a refused request changes nothing
            session, step = self.step_session(sid, owner, go_on=go_on)
            return step_view(session, step, layer=layer, width=self._width(width))

    def rebuild(self, old_id: str, who: Requester = NOBODY, *, layer: int = 0, width: int = 900) -> dict:
        stone = self.sessions.tombstone(old_id, who.owner)
        if stone is not None and stone["model"] in self.registry.models:
            self._check_layer(self.registry.models[stone["model"]], layer)
        session = self.rebuild_session(old_id, who)
        with self.sessions.hold(session.id, who.owner):
            self._check_layer(session.lm, layer)
            return step_view(session, session.steps[-1], layer=layer, width=self._width(width))

    def row(self, sid: str, owner: str, layer: int, width: int) -> dict:
        """The newest step's attention in another layer, pooled to ``width`` columns (the page's layer select)."""
        with self.sessions.hold(sid, owner) as session:
            return attention_view(session, layer, self._width(width))

    def cell(self, sid: str, owner: str, layer: int, head: int, pos: int) -> dict:
        """One exact weight of the newest step's row (what a hover over a pooled column names)."""
        with self.sessions.hold(sid, owner) as session:
            return attention_cell(session, layer, head, pos)

    def _width(self, width: int) -> int:
        return max(1, min(width, self.limits.decode_max_row_width))

    @staticmethod
    def _check_layer(lm: LoadedModel, layer: int) -> None:
        if not 0 <= layer < lm.adapter.n_layer:
            raise BadInput("err.index.layer", layer=layer, last=lm.adapter.n_layer - 1)

    def cache_rows(self, sid: str, owner: str, layer: int, head: int, last: int) -> dict:
        """The newest ``last`` cached K/V rows of one head (at least 1, at most ``decode_max_cache_rows``)."""
        with self.sessions.hold(sid, owner) as session:
            return cache_rows(session, layer, head, max(1, min(last, self.limits.decode_max_cache_rows)))

    def close(self, sid: str, owner: str = "") -> dict:
        return {"released": self.sessions.delete(sid, owner)}

    def timing(self, *, model: str | None, prompt: str | None) -> dict:
        """"What the cache saves", raced fairly (``app/model/timing.py``): a plain cached step vs a plain recompute,
        medians of ``decode_timing_repeats`` with their spread, on the prompt and on the first
        ``decode_timing_tokens`` tokens of the built-in long text (where the saving shows), each with its verdict."""
        lm = self.registry.pick(model)
        st = self.limits
        ids = encode_prompt(lm, prompt, max_chars=st.max_prompt_chars, reserve=1)
        if len(ids) < 2:
            raise BadInput("err.decode.timing_short")
        n_long = min(st.decode_timing_tokens, lm.max_positions)
        long_ids = lm.encode(long_text())[:n_long]
        with self.gate:
            short = time_step_vs_recompute(lm.model, ids, repeats=st.decode_timing_repeats)
            long = time_step_vs_recompute(lm.model, long_ids, repeats=st.decode_timing_repeats) \
                if len(long_ids) > len(ids) else None
        return saving_view(short, long, layers=lm.adapter.n_layer) | {"model": lm.name}

    def stats(self, owner: str = "") -> dict:
        """Sessions on the whole server (shared by every browser) and how many are this browser's."""
        return {**self.sessions.stats(), "mine": self.sessions.owned_by(owner)}

    def verify(self, sid: str, index: int, owner: str = "") -> dict:
        """Step ``index`` recomputed from the full prefix with no cache. Not under the session lock: a check only
        reads steps already taken (the list only grows), so the next step need not wait for it. A session
        released meanwhile has no steps left: 410."""
        session = self.sessions.get(sid, owner)
        if not 0 <= index < len(session.steps):
            raise BadInput("err.session.step_range", index=index, last=len(session.steps) - 1)
        with self.gate:
            try:
                return session.verify(index)
            except IndexError:
                raise Expired("err.session.ended") from None

    # --- the sessions themselves --------------------------------------------------------------------------
    def start_session(self, *, model: str | None, prompt: str | None, sampling: Sampling, who: Requester = NOBODY,
                      chat: bool = False) -> DecodeSession:
        lm = self.registry.pick(model)
        st = self.limits
        # A long prompt decodes too (the step's attention row then spans thousands of cached positions): the long
        # prompts' limits (characters, then ``max_context_tokens``); its cache's bytes are checked against the
        # sessions' budget before the prefill runs (``SessionStore.room``).
        ids = encode_prompt(lm, prompt, max_chars=max(st.max_prompt_chars, st.long_max_chars), reserve=1, chat=chat)
        if len(ids) > st.max_context_tokens:
            raise BadInput("err.long.tokens", n=f"{len(ids):,}", model=lm.name, limit=f"{st.max_context_tokens:,}")
        return self._prefilled(lm, ids, sampling.validate(), who)

    def rebuild_session(self, old_id: str, who: Requester = NOBODY) -> DecodeSession:
        """A new session whose prompt is every token of an ended one: one prefill rebuilds its cache."""
        stone = self.sessions.tombstone(old_id, who.owner)
        if stone is None:
            raise Expired("err.session.forgotten")
        lm = self.registry.pick(stone["model"])
        if stone["model_ref"]() is not lm:
            raise Expired("limits.model_changed", model=stone["model"])
        ids = stone["ids"][: lm.max_positions - 1]
        return self._prefilled(lm, ids, Sampling(**stone["sampling"]), who)

    def _prefilled(self, lm: LoadedModel, ids: list[int], sampling: Sampling, who: Requester) -> DecodeSession:
        session = self.sessions.create(lm, ids, sampling, who=who)
        owner = who.owner
        try:
            with self.sessions.hold(session.id, owner), self.sessions.room(session, len(ids)), \
                    self.gate.for_tokens(len(ids)):  # a short prompt's prefill is short work
                session.prefill()
        except Exception:
            self.sessions.delete(session.id, owner)  # a refused or failed prefill leaves nothing behind
            raise
        return session

    def step_session(self, sid: str, owner: str = "", *, go_on: bool = False) -> tuple[DecodeSession, Step]:
        with self.sessions.hold(sid, owner) as session:
            if session.at_limit:
                raise BadInput("err.session.limit", steps=session.max_steps, positions=session.lm.max_positions)
            if session.ended and not go_on:
                raise BadInput("err.session.ended_at_end", token=session.lm.end_text(), n=len(session.steps))
            session.go_on = go_on
            with self.sessions.room(session, 1), self.gate.short():
                step = session.step()
        return session, step
