"""The guided lesson (/api/lesson): its stops for one model, with sentences about the heads measured on that model.

``LessonLab`` reads what other labs made: the head-roles survey (``app/labs/heads.py``, once per model), the
trace Inspect shows at the lesson's first stops (``app/labs/inspect.py``) and the long text the long-context stop
captures (``app/labs/long.py``, cut for the model); the stops themselves are ``app/viz/lesson.py``'s.
"""

from __future__ import annotations

from app.errors import BadInput
from app.i18n import catalog, translator
from app.labs.heads import HeadsLab
from app.labs.inspect import InspectLab
from app.labs.long import LongLab
from app.quota import Requester
from app.viz.explain import sinks_view
from app.viz.lesson import LONG_TOKENS, PROMPT, lesson_view, measured_heads
from app.viz.models import model_card
from app.viz.summaries import first_token_shares


class LessonLab:
    def __init__(self, *, heads: HeadsLab, inspect: InspectLab, long: LongLab) -> None:
        self.heads = heads
        self.inspect = inspect
        self.long = long

    def view(self, model: str | None, lang: str, *, who: Requester) -> dict:
        """Every stop of the lesson on ``PROMPT``: page, highlighted element, text, the controls it drives."""
        lm = self.heads.registry.pick(model)
        try:  # the head-roles survey, computed once per model (the /heads page's)
            roles = self.heads.surveys.get(lm, self.heads.gate).scores
        except BadInput:  # a vocabulary the survey cannot build its sequence from: no sentences about roles
            roles = None
        _, _, trace = self.inspect.trace_prompt(lm.name, PROMPT, who=who)
        sinks = sinks_view(first=1, token_texts=trace.token_texts, shares=first_token_shares(trace, 1))
        return lesson_view(model_card(lm), translator(lang), lambda key: key in catalog("en"),
                           measured_heads(roles, sinks), long_prompt=self.long.opening(lm, LONG_TOKENS))
