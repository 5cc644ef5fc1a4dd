"""Token strip and top-k table view data."""

from __future__ import annotations

from app.model.loading import LoadedModel
from app.model.sampling import Candidate

VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}


def visible(text: str) -> str:
    """Make whitespace visible, so ' cat' shows its leading space as '␣cat'."""
    return "".join(VISIBLE.get(ch, ch) for ch in text) or "∅"


def token_strip(ids: list[int], texts: list[str], *, offset: int = 0) -> list[dict]:
    return [
        {"pos": offset + i, "id": tid, "text": text, "shown": visible(text)}
        for i, (tid, text) in enumerate(zip(ids, texts, strict=True))
    ]


def candidate_rows(lm: LoadedModel, candidates: list[Candidate], *, chosen: int | None = None) -> list[dict]:
    """A top-k table: each candidate's text (spaces visible), id, probabilities, and whether it was chosen."""
    rows = []
    for c in candidates:
        text = lm.token_text(c.id)
        rows.append({"rank": c.rank, "id": c.id, "text": text, "shown": visible(text), "prob": c.prob,
                     "sample_prob": c.sample_prob, "chosen": c.id == chosen})
    return rows
