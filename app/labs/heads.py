"""The head-roles lab (/heads): one captured forward over a repeated random sequence, every head scored, kept
per model; ``HeadsLab.view`` is what its routes call.

The sequence is n tokens drawn at random (seeded, each once) followed by the same n again. It is made of tokens
that survive the trip through text: decoding the ids and encoding the text gives the very same ids, so Inspect,
handed the text in its URL, runs exactly the tokens the scores were computed on. Word pieces with a leading
space (" cat") are preferred because a BPE tokenizer splits text at spaces before merging, so a sequence of
them cannot merge across token boundaries; a character-level vocabulary (the built-in model) has none, and
single letters are drawn instead.

Attention is captured by ``run_traced`` through the model's adapter; the scores are ``app.viz.head_roles``'s.
A survey is small (the ids and L × H numbers per role), computed once per loaded model under the model lock
and kept by ``SurveyCache`` for as long as that model object is served.
"""

from __future__ import annotations

import random
import re
import threading
import weakref
from dataclasses import dataclass
from typing import cast

import torch

from app.admission import ModelGate
from app.errors import BadInput
from app.model.capture import run_traced
from app.model.loading import LoadedModel, ModelRegistry
from app.viz.head_roles import head_roles_view, score_table

PERIOD = 40  # tokens per copy: 2 × 40 = 80 tokens, short enough for the built-in model's 128 positions
SEED = 0
WORD = re.compile(r" [A-Za-z]{2,}")  # a word piece after a space: BPE never merges it with its neighbours
LETTERS = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class HeadSurvey:
    model: str
    ids: list[int]  # 2 × period token ids: the random tokens, then the same again
    text: str  # what Inspect is given; encodes back to ``ids``
    token_texts: list[str]
    period: int
    scores: dict[str, torch.Tensor]  # role -> (L, H), app.viz.head_roles.ROLES

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


def _round_trips(lm: LoadedModel, token_id: int, pattern: re.Pattern) -> bool:
    text = lm.token_text(token_id)
    return bool(pattern.fullmatch(text)) and lm.encode(text) == [token_id]


def repeated_random_ids(lm: LoadedModel, *, period: int = PERIOD, seed: int = SEED) -> tuple[list[int], str]:
    """``period`` distinct random tokens twice over, and the text that encodes to exactly those ids.

    Vocabulary ids are visited in a seeded random order and the first ``period`` that round-trip alone are
    taken: word pieces with a leading space if the vocabulary has enough of them, else single-run letters."""
    n_vocab = min(len(lm.tokenizer), lm.adapter.vocab_size)
    order = list(range(n_vocab))
    random.Random(seed).shuffle(order)
    words: list[int] = []
    letters: list[int] = []
    for token_id in order:
        if _round_trips(lm, token_id, WORD):
            words.append(token_id)
            if len(words) == period:
                break
        elif len(letters) < period and _round_trips(lm, token_id, LETTERS):
            letters.append(token_id)
    chosen = words if len(words) == period else letters
    ids = chosen * 2
    # one sequence of ids decodes to one string (transformers types decode's result str | list[str])
    text = cast(str, lm.tokenizer.decode(ids, clean_up_tokenization_spaces=False))
    if len(chosen) < period or lm.encode(text) != ids:
        raise BadInput("err.heads.vocab", model=lm.name, n=period)
    return ids, text


def period_for(lm: LoadedModel) -> int:
    """``PERIOD``, or less when two copies would not fit the model's positions."""
    return min(PERIOD, lm.max_positions // 2)


def survey_heads(lm: LoadedModel, *, period: int | None = None, seed: int = SEED) -> HeadSurvey:
    """Run the repeated sequence through the model once (captured) and score every head on every role.
    The caller holds the model lock."""
    period = period or period_for(lm)
    ids, text = repeated_random_ids(lm, period=period, seed=seed)
    texts = lm.token_texts(ids)
    trace = run_traced(lm.model, lm.adapter, ids, texts, keep_cache=False, all_logits=False)
    weights = [trace.weights(layer)[0] for layer in range(lm.adapter.n_layer)]  # each (H, T, T)
    scores = score_table(weights, period=period)
    return HeadSurvey(model=lm.name, ids=ids, text=text, token_texts=texts, period=period, scores=scores)


class SurveyCache:
    """One survey per served model, computed on first request under the model lock.

    Keyed by model name and holding a weak reference to the model object it ran on: a model served again under
    the same name (other weights) gets a new survey. Two requests arriving together run the forward once — the
    second finds the first one's survey when it gets the lock."""

    def __init__(self) -> None:
        self._surveys: dict[str, tuple[weakref.ref, HeadSurvey]] = {}
        self._guard = threading.Lock()

    def cached(self, lm: LoadedModel) -> HeadSurvey | None:
        """The survey made for this very model object, or None (nothing is computed)."""
        return self._cached(lm)

    def _cached(self, lm: LoadedModel) -> HeadSurvey | None:
        with self._guard:
            hit = self._surveys.get(lm.name)
        return hit[1] if hit is not None and hit[0]() is lm else None

    def get(self, lm: LoadedModel, lock) -> HeadSurvey:
        survey = self._cached(lm)
        if survey is not None:
            return survey
        with lock:
            survey = self._cached(lm)
            if survey is None:
                survey = survey_heads(lm)
                with self._guard:
                    self._surveys[lm.name] = (weakref.ref(lm), survey)
        return survey

    def __len__(self) -> int:
        return len(self._surveys)


class HeadsLab:
    """/heads: the survey of the model asked for (computed once per served model, under the model gate), as view
    data."""

    def __init__(self, *, registry: ModelRegistry, gate: ModelGate, surveys: SurveyCache | None = None) -> None:
        self.registry = registry
        self.gate = gate
        self.surveys = surveys if surveys is not None else SurveyCache()

    def survey(self, model: str | None) -> tuple[LoadedModel, HeadSurvey]:
        lm = self.registry.pick(model)
        return lm, self.surveys.get(lm, self.gate)

    def kept_view(self, model: str | None) -> tuple[LoadedModel, dict] | None:
        """The view of a survey already made for ``model`` (no model work), or None if none is kept."""
        lm = self.registry.pick(model)
        survey = self.surveys.cached(lm)
        return None if survey is None else (lm, self._view(lm, survey))

    def view(self, model: str | None) -> dict:
        """Every (layer, head)'s score on each role, the strongest heads, the test sequence, the Inspect links."""
        lm, survey = self.survey(model)
        return self._view(lm, survey)

    @staticmethod
    def _view(lm: LoadedModel, survey: HeadSurvey) -> dict:
        return head_roles_view(survey.scores, kv_map=lm.adapter.kv_map, model=lm.name, text=survey.text,
                               ids=survey.ids, token_texts=survey.token_texts, period=survey.period)
