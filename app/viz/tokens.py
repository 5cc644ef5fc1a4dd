"""Token strip view data."""

from __future__ import annotations

VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}


def visible(text: str) -> str:
    """Make whitespace visible, so ' cat' shows its leading space as '␣cat'."""
    return "".join(VISIBLE.get(ch, ch) for ch in text) or "∅"


def token_strip(ids: list[int], texts: list[str], *, offset: int = 0) -> list[dict]:
    return [
        {"pos": offset + i, "id": tid, "text": text, "shown": visible(text)}
        for i, (tid, text) in enumerate(zip(ids, texts, strict=True))
    ]
