"""Turning a user's text into token ids, with the limits every page shares."""

from __future__ import annotations

from app.errors import BadInput
from app.model.loading import LoadedModel


def encode_prompt(lm: LoadedModel, text: str | None, *, max_chars: int, reserve: int = 0) -> list[int]:
    """Token ids of ``text``; ``reserve`` positions are kept free (for tokens to be generated)."""
    if text is None or not text.strip():
        raise BadInput("The prompt is empty: type some text first.")
    if len(text) > max_chars:
        raise BadInput(f"The prompt has {len(text):,} characters; the limit is {max_chars:,}.")
    ids = lm.encode(text)
    if not ids:
        raise BadInput("The prompt produced no tokens.")
    limit = lm.max_positions - reserve
    if len(ids) > limit:
        raise BadInput(
            f"The prompt is {len(ids):,} tokens long; {lm.name} reads at most {limit:,} tokens"
            + (f" ({lm.max_positions:,} positions, {reserve} kept for generation)." if reserve else ".")
        )
    return ids
