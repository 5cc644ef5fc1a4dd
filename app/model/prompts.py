"""Turning a user's text into token ids, with the limits every page shares."""

from __future__ import annotations

from app.errors import BadInput
from app.model.loading import LoadedModel


def encode_prompt(lm: LoadedModel, text: str | None, *, max_chars: int, reserve: int = 0,
                  chat: bool = False) -> list[int]:
    """Token ids of ``text``; ``reserve`` positions are kept free (for tokens to be generated). ``chat``: the text
    as a user turn in the model's chat template (an instruct model), special tokens and all."""
    if text is None or not text.strip():
        raise BadInput("err.prompt.empty")
    if len(text) > max_chars:
        raise BadInput("err.prompt.chars", n=f"{len(text):,}", limit=f"{max_chars:,}")
    if chat and not lm.has_chat_template:
        raise BadInput("err.prompt.no_chat_template", model=lm.name)
    ids = lm.encode_chat(text) if chat else lm.encode(text)
    if not ids:
        raise BadInput("err.prompt.no_tokens")
    limit = lm.max_positions - reserve
    if len(ids) > limit:
        if reserve:
            raise BadInput("err.prompt.tokens_reserve", n=f"{len(ids):,}", model=lm.name, limit=f"{limit:,}",
                           positions=f"{lm.max_positions:,}", reserve=reserve)
        raise BadInput("err.prompt.tokens", n=f"{len(ids):,}", model=lm.name, limit=f"{limit:,}")
    return ids
